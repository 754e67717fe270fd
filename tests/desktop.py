"""Real desktop pieces for tests: Xvfb on a free display, a private D-Bus session bus, and a skip
helper for tools that may be missing (installed by .ci/run)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


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
def xvfb(size: str = "1280x800x24") -> Iterator[str]:
    """Start Xvfb on a free display; yield ``:N`` once it answers; stop it after."""
    need("Xvfb", "xdpyinfo")
    for _attempt in range(3):
        display = f":{_free_display()}"
        proc = subprocess.Popen(["Xvfb", display, "-screen", "0", size, "-nolisten", "tcp"],
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
    try:
        yield display
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def xdotool(display: str, *args: str) -> None:
    subprocess.run(["xdotool", *args], env={**os.environ, "DISPLAY": display}, check=True, timeout=10)


@contextlib.contextmanager
def dbus_session() -> Iterator[str]:
    """A private ``dbus-daemon --session``; yields its address."""
    need("dbus-daemon")
    proc = subprocess.Popen(["dbus-daemon", "--session", "--nofork", "--print-address=1"],
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
