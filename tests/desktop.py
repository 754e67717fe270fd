"""Real desktop pieces for tests: Xvfb on a free display (optionally with a window manager and a tray
host, openbox + trayer, so QSystemTrayIcon.isSystemTrayAvailable() is True), a private D-Bus
session bus, and a skip helper for tools that may be missing (installed by .ci/run)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dedloc_core import proctree


def need(*tools: str) -> None:
    """Skip the test unless every tool is on PATH."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (apt-get install: see .ci/run)")


def _free_display() -> int:
    for n in range(90, 200):
        if not Path(f"/tmp/.X11-unix/X{n}").exists() and not Path(f"/tmp/.X{n}-lock").exists():
            return n
    raise RuntimeError("no free X display number")


@contextlib.contextmanager
def xvfb(size: str = "1280x800x24", *, tray: bool = False) -> Iterator[str]:
    """Start Xvfb on a free display (with ``tray``: openbox and trayer too); yield ``:N`` once it
    answers; stop them all after."""
    need("Xvfb", "xdpyinfo", *(("openbox", "trayer", "xdotool") if tray else ()))
    for _attempt in range(3):
        display = f":{_free_display()}"
        # -noreset: Xvfb otherwise resets when its last client leaves (the xdpyinfo probe) and refuses
        # connections meanwhile; openbox or trayer starting then dies with "cannot open display"
        proc = subprocess.Popen(["Xvfb", display, "-screen", "0", size, "-nolisten", "tcp", "-noreset"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and proc.poll() is None:
            ok = subprocess.run(["xdpyinfo", "-display", display], capture_output=True).returncode == 0
            if ok:
                break
            time.sleep(0.1)
        if proc.poll() is None:
            break  # raced for the display number with another Xvfb otherwise: try the next
    else:
        raise RuntimeError("Xvfb did not start")
    procs = [proc]
    try:
        if tray:
            env = {**os.environ, "DISPLAY": display}
            quiet = {"env": env, "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
            commands = (["openbox"], ["trayer", "--edge", "top", "--align", "right", "--widthtype", "request",
                                      "--height", "24", "--transparent", "false"])
            tray_procs = [subprocess.Popen(c, **quiet) for c in commands]
            procs.extend(tray_procs)
            deadline = time.monotonic() + 60
            while not _tray_shown(env):  # trayer maps its window once it owns the tray selection
                if time.monotonic() > deadline:
                    raise RuntimeError("the tray host (trayer) did not come up")
                for i, p in enumerate(tray_procs):
                    if p.poll() is not None:  # died early: start it again
                        tray_procs[i] = subprocess.Popen(commands[i], **quiet)
                        procs.append(tray_procs[i])
                time.sleep(0.2)
        yield display
    finally:
        for p in reversed(procs):
            stop(p, 5)


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Terminate ``proc``; kill it (with its process group) if it has not exited within ``timeout`` seconds."""
    proctree.stop_process(proc, timeout)


def _tray_shown(env: dict[str, str]) -> bool:
    out = subprocess.run(["xdotool", "search", "--class", "trayer"], env=env, capture_output=True, text=True)
    return bool(out.stdout.strip())


def xdotool(display: str, *args: str) -> None:
    subprocess.run(["xdotool", *args], env={**os.environ, "DISPLAY": display}, check=True, timeout=10)


BUS_CONF = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
  <listen>unix:tmpdir=/tmp</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
    <allow own="*"/>
  </policy>
</busconfig>
"""


@contextlib.contextmanager
def dbus_session() -> Iterator[str]:
    """A private session bus without service activation; yields its address. (The session config's
    activation started a second gnome-keyring, without a login keyring, whenever a call came before
    the test's own had taken the name: 9 of 30 starts; and a bus "where nobody owns a name" must not
    start whatever service is installed for it.)"""
    need("dbus-daemon")
    folder = tempfile.mkdtemp(prefix="dbus-")
    conf = Path(folder) / "bus.conf"
    conf.write_text(BUS_CONF)
    proc = subprocess.Popen(["dbus-daemon", f"--config-file={conf}", "--nofork", "--print-address=1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        if not address:
            raise RuntimeError("dbus-daemon printed no address")
        yield address
    finally:
        proc.terminate()
        proc.wait(5)
        shutil.rmtree(folder, ignore_errors=True)


APPINDICATOR = "ubuntu-appindicators@ubuntu.com"  # Debian's gnome-shell-extension-appindicator


@contextlib.contextmanager
def gnome_session(folder: Path) -> Iterator[dict[str, str]]:
    """A real GNOME Shell (mutter, X11 mode) on Xvfb with Debian's AppIndicator extension enabled, its
    own session bus (with service activation: dconf) and a stand-in system bus; yields the environment
    that reaches it (DISPLAY, DBUS_SESSION_BUS_ADDRESS, HOME, XDG_*) once Mutter's IdleMonitor answers
    and a StatusNotifier host is registered. Needs root (gnome-shell must not find logind: there is no
    system bus here, so /run/systemd is hidden in a mount namespace of its own)."""
    need("gnome-shell", "gsettings", "gdbus", "dbus-daemon", "unshare")
    if not Path("/usr/share/gnome-shell/extensions", APPINDICATOR).is_dir():
        pytest.skip("needs gnome-shell-extension-appindicator (apt-get install: see .ci/run)")
    if os.geteuid() != 0:
        pytest.skip("gnome-shell here runs in a mount namespace (root)")
    home, runtime = folder / "home", folder / "run"
    home.mkdir(parents=True)
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
           "XDG_DATA_HOME": str(home / ".local" / "share"), "XDG_RUNTIME_DIR": str(runtime), "NO_AT_BRIDGE": "1"}
    env.pop("DBUS_SESSION_BUS_ADDRESS", None)
    procs: list[subprocess.Popen] = []
    with xvfb() as display:
        env["DISPLAY"] = display
        try:
            for bus, name in (("session", "DBUS_SESSION_BUS_ADDRESS"), ("system", "DBUS_SYSTEM_BUS_ADDRESS")):
                daemon = subprocess.Popen(["dbus-daemon", "--config-file=/usr/share/dbus-1/session.conf", "--nofork",
                                           f"--address=unix:path={folder}/{bus}-bus", "--print-address=1"],
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
                procs.append(daemon)
                env[name] = daemon.stdout.readline().strip()  # type: ignore[union-attr]
            subprocess.run(["gsettings", "set", "org.gnome.shell", "enabled-extensions", f"['{APPINDICATOR}']"],
                           env=env, check=True, timeout=30)
            shell = "exec gnome-shell --x11 --replace --sm-disable"
            if Path("/run/systemd/seats").exists():  # gnome-shell would take it for logind and fail without it
                shell = "mount -t tmpfs tmpfs /run/systemd && " + shell
            procs.append(subprocess.Popen(["unshare", "--mount", "sh", "-c", shell], env=env,
                                          stdout=subprocess.DEVNULL, stderr=open(folder / "gnome-shell.log", "w")))
            deadline = time.monotonic() + 120
            while not (_answers(env, "org.gnome.Mutter.IdleMonitor", "/org/gnome/Mutter/IdleMonitor/Core",
                                "org.gnome.Mutter.IdleMonitor.GetIdletime")
                       and "true" in _answers(env, "org.kde.StatusNotifierWatcher", "/StatusNotifierWatcher",
                                              "org.freedesktop.DBus.Properties.Get", "org.kde.StatusNotifierWatcher",
                                              "IsStatusNotifierHostRegistered")):
                if time.monotonic() > deadline or procs[-1].poll() is not None:
                    raise RuntimeError("GNOME Shell did not come up: "
                                       + (folder / "gnome-shell.log").read_text()[-3000:])
                time.sleep(0.5)
            yield env
        finally:
            for p in reversed(procs):
                stop(p, 10)
            _kill_activated(str(runtime))


def _kill_activated(runtime: str) -> None:
    """The services the session bus started (dconf, the a11y bus, the shell's calendar server): they
    share the session's XDG_RUNTIME_DIR and may outlive its bus for a moment."""
    import psutil

    for proc in psutil.process_iter():
        try:
            if proc.environ().get("XDG_RUNTIME_DIR") == runtime:
                proc.kill()
        except psutil.Error:
            pass


def _answers(env: dict[str, str], dest: str, path: str, method: str, *args: str) -> str:
    """What a D-Bus call on the session bus returned ("" if it failed)."""
    out = subprocess.run(["gdbus", "call", "--session", "--dest", dest, "--object-path", path, "--method", method,
                          *args], env=env, capture_output=True, text=True, timeout=10)
    return out.stdout if out.returncode == 0 else ""
