; Inno Setup recipe for Windows (run on Windows: `pyinstaller installers\dedloc.spec`, then
; `iscc installers\windows\dedloc.iss`). Not built by CI.
;
; STATUS: Windows is NOT supported yet. hivemind needs fork, uvloop and Unix sockets, and its p2pd
; daemon ships for Linux and macOS only, so the training worker cannot run on native Windows. This
; installer packages the tray app and the command line only, and says so before installing. To
; volunteer from Windows today, use WSL2 (Ubuntu) and install the Linux .deb inside it (WSLg shows
; the app's window). See README, section "Platforms".

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

[Icons]
Name: "{group}\{#AppName}"; Filename: "{app}\dedloc.exe"; Parameters: "app"
Name: "{group}\Uninstall {#AppName}"; Filename: "{uninstallexe}"

[Registry]
; Removes the start-at-login entry the app may write (dedloc_core.autostart.WindowsRunKey).
Root: HKCU; Subkey: "Software\Microsoft\Windows\CurrentVersion\Run"; ValueName: "{#AppName}"; Flags: uninsdeletevalue dontcreatekey

[Code]
function InitializeSetup(): Boolean;
begin
  Result := MsgBox('Windows is not supported yet: the training worker (hivemind) runs only on Linux and macOS.' + #13#10 + #13#10 +
    'To volunteer from this PC, install the Linux package inside WSL2 (Ubuntu) instead.' + #13#10 + #13#10 +
    'Install the app anyway (it can show experiments and statistics but cannot train)?',
    mbConfirmation, MB_YESNO) = IDYES;
end;
