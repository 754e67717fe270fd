"""Windows idle time: ``GetLastInputInfo`` (user32) against ``GetTickCount`` (kernel32)."""

from __future__ import annotations

import ctypes
import sys

from .base import IdleSource, IdleUnavailable


class _LastInputInfo(ctypes.Structure):
    _fields_ = [("cbSize", ctypes.c_uint), ("dwTime", ctypes.c_uint)]


class WindowsIdle(IdleSource):
    name = "Windows GetLastInputInfo"

    def __init__(self) -> None:
        if not sys.platform.startswith("win"):
            raise IdleUnavailable("not Windows")
        windll = ctypes.windll  # type: ignore[attr-defined]
        self._user32, self._kernel32 = windll.user32, windll.kernel32
        self._info = _LastInputInfo(cbSize=ctypes.sizeof(_LastInputInfo))

    def seconds(self) -> float | None:
        if not self._user32.GetLastInputInfo(ctypes.byref(self._info)):
            return None
        now = self._kernel32.GetTickCount() & 0xFFFFFFFF
        return ((now - self._info.dwTime) & 0xFFFFFFFF) / 1000.0  # both wrap after 49.7 days
