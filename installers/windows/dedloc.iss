; Inno Setup recipe for Windows (run on Windows: `pyinstaller installers\dedloc.spec`, then
; `iscc installers\windows\dedloc.iss`, with the WSL distro built on Linux by `make bundle` copied to
; dist\dedloc-volunteer-wsl.tar.gz). Not built by CI, never run on Windows by us: see README, "Platforms".
;
; The tray app runs natively; the training worker runs in a WSL2 distro of its own ("DeDLOC"), imported
; from the tarball, which the app starts as `wsl.exe -d DeDLOC --exec /usr/bin/dedloc worker` and drives
; over stdin and stdout only (dedloc_core.prefs.WSL_WORKER). hivemind needs fork, uvloop and Unix
; sockets, and its p2pd daemon ships for Linux and macOS only: no worker runs on Windows itself. Where
; WSL is missing the installer says how to enable it, and installs the app anyway.

#define AppName "DeDLOC Volunteer"
#ifndef AppVersion
  #define AppVersion "0.1.0"
#endif

[Setup]
AppId={{6F0E6C84-4C47-4E3B-9B6B-0D3E5D5C9A11}
AppName={#AppName}
AppVersion={#AppVersion}
AppPublisher=DeDLOC Volunteer project
DefaultDirName={autopf}\DeDLOC Volunteer
DefaultGroupName={#AppName}
PrivilegesRequired=lowest
PrivilegesRequiredOverridesAllowed=dialog
OutputDir=..\..\dist
OutputBaseFilename=dedloc-volunteer-{#AppVersion}-windows-x64-setup
Compression=lzma2/fast
SolidCompression=no
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
UninstallDisplayIcon={app}\dedloc.exe
WizardStyle=modern

[Files]
; The PyInstaller one-folder bundle (dist\dedloc\dedloc.exe and dist\dedloc\_internal).
Source: "..\..\dist\dedloc\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs
; The worker's distro (installers/build_wsl.sh), imported below and then deleted.
Source: "..\..\dist\dedloc-volunteer-wsl.tar.gz"; DestDir: "{tmp}"; Flags: deleteafterinstall

[Run]
; Replaces an older import of the distro (its data folder: the worker's identity and cache go with it).
Filename: "{sys}\wsl.exe"; Parameters: "--unregister DeDLOC"; Flags: runhidden; Check: HasWsl
Filename: "{sys}\wsl.exe"; Parameters: "--import DeDLOC ""{localappdata}\DeDLOC Volunteer\wsl"" ""{tmp}\dedloc-volunteer-wsl.tar.gz"" --version 2"; StatusMsg: "Setting up the training worker (WSL2)..."; Flags: runhidden; Check: HasWsl

[UninstallRun]
Filename: "{sys}\wsl.exe"; Parameters: "--unregister DeDLOC"; Flags: runhidden; RunOnceId: "UnregisterDistro"

[Icons]
Name: "{group}\{#AppName}"; Filename: "{app}\dedloc.exe"; Parameters: "app"
Name: "{group}\Uninstall {#AppName}"; Filename: "{uninstallexe}"

[Registry]
; Removes the start-at-login entry the app may write (dedloc_core.autostart.WindowsRunKey).
Root: HKCU; Subkey: "Software\Microsoft\Windows\CurrentVersion\Run"; ValueName: "{#AppName}"; Flags: uninsdeletevalue dontcreatekey

[Code]
function HasWsl(): Boolean;
begin
  Result := FileExists(ExpandConstant('{sys}\wsl.exe'));
end;

function InitializeSetup(): Boolean;
begin
  Result := True;
  if not HasWsl() then
    Result := MsgBox('The training worker runs in WSL2, which is not enabled on this PC.' + #13#10 + #13#10 +
      'To enable it, open PowerShell as administrator, run "wsl --install", restart, and run this installer again.' + #13#10 + #13#10 +
      'Install the app anyway (it can show experiments and statistics but cannot train)?',
      mbConfirmation, MB_YESNO) = IDYES;
end;
