"""A real X desktop for tests and benchmarks: Xvfb on a free display, optionally a window manager and
a tray host (openbox + trayer), so QSystemTrayIcon.isSystemTrayAvailable() is True."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest


def need(*tools: str) -> None:
    """Skip the test, naming what is missing, when a tool is not installed."""
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (installed by .ci/run with apt-get)")


def _free_display() -> int:
    for number in range(90, 200):
        if not os.path.exists(f"/tmp/.X11-unix/X{number}") and not os.path.exists(f"/tmp/.X{number}-lock"):
            return number
    raise RuntimeError("no free X display number")


def _wait(check, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not come up within {timeout:.0f} s")


@contextlib.contextmanager
def xvfb(tray: bool = False, size: str = "1280x800x24") -> Iterator[str]:
    """Start Xvfb (and with ``tray`` openbox + trayer); yield the DISPLAY string; stop them all."""
    number = _free_display()
    display = f":{number}"
    env = dict(os.environ, DISPLAY=display)
    procs = [subprocess.Popen(["Xvfb", display, "-screen", "0", size, "-nolisten", "tcp"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        _wait(lambda: subprocess.run(["xdpyinfo"], env=env, capture_output=True).returncode == 0,
              "Xvfb", timeout=60)
        if tray:
            procs.append(subprocess.Popen(["openbox"], env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
            procs.append(subprocess.Popen(["trayer", "--edge", "top", "--align", "right", "--widthtype",
                                           "request", "--height", "24", "--transparent", "false"],
                                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            _wait(lambda: _tray_owned(env), "the tray host", timeout=60)
        yield display
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _tray_owned(env: dict[str, str]) -> bool:
    """trayer maps its window once it owns the tray selection."""
    out = subprocess.run(["xdotool", "search", "--class", "trayer"], env=env, capture_output=True, text=True)
    return bool(out.stdout.strip())


@pytest.fixture
def xdisplay(monkeypatch) -> Iterator[str]:
    """A fresh Xvfb for one test; DISPLAY points at it."""
    need("Xvfb", "xdpyinfo")
    with xvfb() as display:
        monkeypatch.setenv("DISPLAY", display)
        yield display
