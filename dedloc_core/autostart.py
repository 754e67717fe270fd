"""Start at login, behind one interface: ``for_platform()`` gives the mechanism of this OS.

- Linux (and other XDG desktops): ``~/.config/autostart/dedloc-volunteer.desktop``.
- macOS: a LaunchAgent, ``~/Library/LaunchAgents/org.dedloc.volunteer.plist`` (RunAtLoad).
- Windows: the ``DeDLOC Volunteer`` value under ``HKCU\\Software\\Microsoft\\Windows\\CurrentVersion\\Run``.
- Anything else: ``NullAutostart`` (``supported`` is False; ``enable`` raises).

Each has ``enable(command=None)``, ``disable()``, ``enabled()`` and ``set(on)``; the command defaults
to ``dedloc app --hidden`` (this frozen executable, or this interpreter). The app calls
``for_platform().set(prefs.start_at_login)`` when the preference is saved. No Qt.
"""

from __future__ import annotations

import os
import platform
import plistlib
import subprocess
from pathlib import Path

from .errors import DedlocError
from .paths import atomic_write
from .workerproc import dedloc_command

APP_TITLE = "DeDLOC Volunteer"
DESKTOP_ID = "dedloc-volunteer"
LAUNCH_AGENT_LABEL = "org.dedloc.volunteer"
RUN_KEY = r"Software\Microsoft\Windows\CurrentVersion\Run"


class AutostartError(DedlocError):
    title = "Start at login"


def launch_command() -> list[str]:
    """The command a login starts: the tray app, hidden in the tray."""
    return dedloc_command("app", "--hidden")


class Autostart:
    """The interface (and the Null fallback): nothing is supported."""

    supported = False
    where = "not supported on this system"

    def enable(self, command: list[str] | None = None) -> None:
        raise AutostartError(f"Starting at login is not supported on {platform.system() or 'this system'}.")

    def disable(self) -> None:
        pass

    def enabled(self) -> bool:
        return False

    def set(self, on: bool, command: list[str] | None = None) -> None:
        """Enable or disable (the ``start_at_login`` preference)."""
        if on:
            self.enable(command)
        else:
            self.disable()


NullAutostart = Autostart


class _FileAutostart(Autostart):
    """An autostart that is one file the OS reads at login."""

    supported = True
    path: Path

    @property
    def where(self) -> str:  # type: ignore[override]
        return str(self.path)

    def render(self, command: list[str]) -> bytes:
        raise NotImplementedError

    def enable(self, command: list[str] | None = None) -> None:
        try:
            atomic_write(self.path, self.render(command or launch_command()))
        except OSError as exc:
            raise AutostartError(f"Cannot write {self.path}: {exc.strerror or exc}.") from exc

    def disable(self) -> None:
        try:
            self.path.unlink(missing_ok=True)
        except OSError as exc:
            raise AutostartError(f"Cannot remove {self.path}: {exc.strerror or exc}.") from exc

    def enabled(self) -> bool:
        return self.path.is_file()


class XdgAutostart(_FileAutostart):
    """The XDG autostart entry (GNOME, KDE, Xfce, LXQt, ...)."""

    def __init__(self, config_home: Path | None = None):
        base = config_home or Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
        self.path = Path(base) / "autostart" / f"{DESKTOP_ID}.desktop"

    def render(self, command: list[str]) -> bytes:
        return desktop_entry(command, autostart=True).encode("utf-8")

    def enabled(self) -> bool:
        try:
            text = self.path.read_text(encoding="utf-8")
        except (FileNotFoundError, UnicodeDecodeError):
            return False
        lines = {line.strip().replace(" ", "") for line in text.splitlines()}
        return not ({"Hidden=true", "X-GNOME-Autostart-enabled=false"} & lines)


class LaunchAgent(_FileAutostart):
    """A per-user launchd agent that runs the app once at login (macOS)."""

    def __init__(self, home: Path | None = None):
        self.path = Path(home or Path.home()) / "Library" / "LaunchAgents" / f"{LAUNCH_AGENT_LABEL}.plist"

    def render(self, command: list[str]) -> bytes:
        return launch_agent_plist(command)


class WindowsRunKey(Autostart):
    """The per-user Run key in the Windows registry."""

    supported = True
    where = "HKEY_CURRENT_USER\\" + RUN_KEY

    def enable(self, command: list[str] | None = None) -> None:
        import winreg

        with winreg.CreateKey(winreg.HKEY_CURRENT_USER, RUN_KEY) as key:
            winreg.SetValueEx(key, APP_TITLE, 0, winreg.REG_SZ, subprocess.list2cmdline(command or launch_command()))

    def disable(self) -> None:
        import winreg

        try:
            with winreg.OpenKey(winreg.HKEY_CURRENT_USER, RUN_KEY, 0, winreg.KEY_SET_VALUE) as key:
                winreg.DeleteValue(key, APP_TITLE)
        except FileNotFoundError:
            pass

    def enabled(self) -> bool:
        import winreg

        try:
            with winreg.OpenKey(winreg.HKEY_CURRENT_USER, RUN_KEY) as key:
                winreg.QueryValueEx(key, APP_TITLE)
            return True
        except FileNotFoundError:
            return False


def for_platform(system: str | None = None) -> Autostart:
    """The start-at-login mechanism of ``system`` (default: this one)."""
    system = system or platform.system()
    if system == "Darwin":
        return LaunchAgent()
    if system == "Windows":
        return WindowsRunKey()
    if system in ("Linux", "FreeBSD", "OpenBSD", "NetBSD"):
        return XdgAutostart()
    return NullAutostart()


# ---- file formats -------------------------------------------------------------------------------


def exec_quote(arg: str) -> str:
    """One argument of a desktop entry's ``Exec`` key (quoting rules of the Desktop Entry spec)."""
    if not arg:
        return '""'
    reserved = set(" \t\n\"'\\><~|&;$*?#()`")
    escaped = arg.replace("%", "%%")
    if not reserved & set(arg):
        return escaped
    for char in ("\\", '"', "`", "$"):
        escaped = escaped.replace(char, "\\" + char)
    return '"' + escaped + '"'


def exec_line(command: list[str]) -> str:
    # The value is also a key-file string, in which a backslash is written twice.
    return " ".join(exec_quote(arg) for arg in command).replace("\\", "\\\\")


def desktop_entry(command: list[str], *, autostart: bool = False, icon: str = DESKTOP_ID,
                  url_handler: bool = False) -> str:
    """A ``.desktop`` file that runs ``command`` (the menu launcher, or the autostart entry). With
    ``url_handler`` it also opens ``dedloc://`` links (an organizer's "add experiments" link)."""
    lines = [
        "[Desktop Entry]",
        "Type=Application",
        f"Name={APP_TITLE}",
        "GenericName=Volunteer computing",
        "Comment=Lend this computer to open, collaborative deep-learning training",
        f"Exec={exec_line(command)}" + (" %u" if url_handler else ""),
        f"Icon={icon}",
        "Terminal=false",
        "Categories=Science;ArtificialIntelligence;",
        "Keywords=hivemind;DeDLOC;volunteer;training;",
    ]
    if autostart:
        lines += ["X-GNOME-Autostart-enabled=true", "X-GNOME-Autostart-Delay=10"]
    else:
        lines += ["StartupNotify=false"]
    if url_handler:
        lines += ["MimeType=x-scheme-handler/dedloc;"]
    return "\n".join(lines) + "\n"


def launch_agent_plist(command: list[str]) -> bytes:
    """The LaunchAgent property list that runs ``command`` once at login."""
    return plistlib.dumps({
        "Label": LAUNCH_AGENT_LABEL,
        "ProgramArguments": list(command),
        "RunAtLoad": True,
        "KeepAlive": False,
        "ProcessType": "Interactive",
        "LimitLoadToSessionType": "Aqua",
    })
