"""Start at login: the XDG autostart entry for real (files in a scratch $XDG_CONFIG_HOME, checked by
desktop-file-validate where installed), the LaunchAgent file, the Exec quoting, and the preference."""

from __future__ import annotations

import plistlib
import shutil
import subprocess
import sys

import pytest

from dedloc_core import autostart
from dedloc_core.autostart import LaunchAgent, NullAutostart, WindowsRunKey, XdgAutostart, for_platform
from dedloc_core.prefs import Preferences

ODD = ["/opt/De DLOC/dedloc", "app", "--hidden", "--name=50% \"quoted\" $HOME `x` back\\slash"]


def parse_exec(line: str) -> list[str]:
    """Undo the key-file escaping, then the Exec quoting (Desktop Entry spec: arguments split at
    spaces; inside double quotes a backslash escapes the next character; %% is a percent sign)."""
    value = line.replace("\\\\", "\\")
    args, i = [], 0
    while i < len(value):
        if value[i] == " ":
            i += 1
            continue
        arg = ""
        if value[i] == '"':
            i += 1
            while value[i] != '"':
                if value[i] == "\\":
                    i += 1
                arg += value[i]
                i += 1
            i += 1
        else:
            while i < len(value) and value[i] != " ":
                arg += value[i]
                i += 1
        args.append(arg.replace("%%", "%"))
    return args


def test_for_platform_picks_the_mechanism():
    assert isinstance(for_platform("Linux"), XdgAutostart)
    assert isinstance(for_platform("Darwin"), LaunchAgent)
    assert isinstance(for_platform("Windows"), WindowsRunKey)
    null = for_platform("Plan9")
    assert isinstance(null, NullAutostart) and not null.supported and not null.enabled()
    with pytest.raises(autostart.AutostartError, match="not supported"):
        null.enable(["x"])
    null.disable()  # harmless


def test_default_command_starts_the_app_hidden():
    cmd = autostart.launch_command()
    assert cmd[:3] == [sys.executable, "-m", "dedloc_core.cli"] and cmd[3:] == ["app", "--hidden"]


def test_xdg_enable_disable_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    entry = XdgAutostart()
    assert entry.path == tmp_path / "cfg" / "autostart" / "dedloc-volunteer.desktop"
    assert not entry.enabled()
    entry.disable()  # nothing to remove: no error

    entry.enable(ODD)
    assert entry.enabled()
    text = entry.path.read_text()
    exec_line = next(line for line in text.splitlines() if line.startswith("Exec="))[len("Exec="):]
    assert parse_exec(exec_line) == ODD
    assert "X-GNOME-Autostart-enabled=true" in text and "Type=Application" in text

    # A user who switched it off in the desktop's own settings: the file stays but is not enabled.
    entry.path.write_text(text + "Hidden=true\n")
    assert not entry.enabled()

    entry.disable()
    assert not entry.path.exists() and not entry.enabled()


def test_preference_switches_it(tmp_path):
    entry = XdgAutostart(config_home=tmp_path)
    entry.set(Preferences(start_at_login=True).start_at_login)
    assert entry.enabled()
    assert "app --hidden" in entry.path.read_text()
    entry.set(Preferences().start_at_login)  # the default is off
    assert not entry.enabled()


def test_unwritable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "cfg"
    blocker.write_text("a file where the directory should be")
    with pytest.raises(autostart.AutostartError, match="Cannot write"):
        XdgAutostart(config_home=blocker).enable(["dedloc"])


@pytest.mark.skipif(not shutil.which("desktop-file-validate"), reason="desktop-file-utils is not installed")
@pytest.mark.parametrize("is_autostart, url_handler", [(True, False), (False, False), (False, True)])
def test_desktop_files_validate(tmp_path, is_autostart, url_handler):
    path = tmp_path / "dedloc-volunteer.desktop"
    path.write_text(autostart.desktop_entry(ODD, autostart=is_autostart, url_handler=url_handler))
    out = subprocess.run(["desktop-file-validate", str(path)], capture_output=True, text=True)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr


def test_launch_agent_plist(tmp_path):
    agent = LaunchAgent(home=tmp_path)
    agent.enable(ODD)
    assert agent.path == tmp_path / "Library" / "LaunchAgents" / "org.dedloc.volunteer.plist"
    data = plistlib.loads(agent.path.read_bytes())
    assert data["Label"] == "org.dedloc.volunteer"
    assert data["ProgramArguments"] == ODD
    assert data["RunAtLoad"] is True and data["KeepAlive"] is False
    if shutil.which("plutil"):  # macOS only
        subprocess.run(["plutil", "-lint", str(agent.path)], check=True)
    agent.disable()
    assert not agent.enabled()


def test_exec_quoting_of_plain_and_empty_args():
    assert autostart.exec_quote("dedloc") == "dedloc"
    assert autostart.exec_quote("") == '""'
    assert autostart.exec_quote("100%") == "100%%"
    assert autostart.exec_line(["/a b/c", "x"]) == '"/a b/c" x'


def test_frozen_build_re_runs_itself(monkeypatch):
    """In a PyInstaller build every child process is this executable again (one place decides)."""
    from dedloc_core import workerproc
    from dedloc_core.catalog import child as catalog_child

    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "executable", "/opt/dedloc-volunteer/dedloc")
    assert workerproc.worker_command() == ["/opt/dedloc-volunteer/dedloc", "--worker"]
    assert workerproc.dedloc_command("backbone", "--x") == ["/opt/dedloc-volunteer/dedloc", "backbone", "--x"]
    assert autostart.launch_command() == ["/opt/dedloc-volunteer/dedloc", "app", "--hidden"]
    assert catalog_child.command() == ["/opt/dedloc-volunteer/dedloc", "--catalog-child"]
    text = autostart.desktop_entry(autostart.launch_command(), autostart=True)
    assert "Exec=/opt/dedloc-volunteer/dedloc app --hidden\n" in text
