"""X11 idle time: ``XScreenSaverQueryInfo`` from libXss via ctypes (about 8 µs a query)."""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable

from .base import IdleSource, IdleUnavailable, load_library

logger = logging.getLogger(__name__)


class _XScreenSaverInfo(ctypes.Structure):
    _fields_ = [
        ("window", ctypes.c_ulong),
        ("state", ctypes.c_int),
        ("kind", ctypes.c_int),
        ("til_or_since", ctypes.c_ulong),
        ("idle", ctypes.c_ulong),  # milliseconds
        ("eventMask", ctypes.c_ulong),
    ]


class X11Idle(IdleSource):
    """The X server's idle time (XScreenSaver extension). Needs ``DISPLAY`` and libXss."""

    def __init__(self, display: str | None = None):
        display = display or os.environ.get("DISPLAY")
        if not display:
            raise IdleUnavailable("no X display")
        self._x = load_library(["libX11.so.6", "libX11.dylib"])
        self._xss = load_library(["libXss.so.1", "libXss.dylib"])
        self._x.XOpenDisplay.restype = ctypes.c_void_p
        self._x.XOpenDisplay.argtypes = [ctypes.c_char_p]
        self._x.XDefaultRootWindow.restype = ctypes.c_ulong
        self._x.XDefaultRootWindow.argtypes = [ctypes.c_void_p]
        self._x.XCloseDisplay.argtypes = [ctypes.c_void_p]
        self._x.XFree.argtypes = [ctypes.c_void_p]
        self._xss.XScreenSaverQueryExtension.argtypes = [
            ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        self._xss.XScreenSaverAllocInfo.restype = ctypes.POINTER(_XScreenSaverInfo)
        self._xss.XScreenSaverQueryInfo.argtypes = [
            ctypes.c_void_p, ctypes.c_ulong, ctypes.POINTER(_XScreenSaverInfo)]
        self._dpy = self._x.XOpenDisplay(display.encode())
        if not self._dpy:
            raise IdleUnavailable(f"cannot open X display {display}")
        event, error = ctypes.c_int(), ctypes.c_int()
        if not self._xss.XScreenSaverQueryExtension(self._dpy, ctypes.byref(event), ctypes.byref(error)):
            self.close()
            raise IdleUnavailable(f"X display {display} lacks the MIT-SCREEN-SAVER extension")
        self._root = self._x.XDefaultRootWindow(self._dpy)
        self._info = self._xss.XScreenSaverAllocInfo()
        self._display, self._watcher = display, None
        self.name = f"X11 screensaver extension ({display})"

    def watch(self, on_input: Callable[[], None]) -> bool:
        """XInput 2 raw events, read by a thread (``x11_input.InputWatcher``)."""
        from .x11_input import InputWatcher

        if self._watcher is None:
            try:
                self._watcher = InputWatcher(self._x, self._display, on_input)
            except IdleUnavailable as exc:
                logger.info("No input events from X11 (%s): the idle time is polled only", exc)
                return False
            self.name += ", input events"
        return True

    def arm(self) -> None:
        if self._watcher is not None:
            self._watcher.arm()

    def seconds(self) -> float | None:
        if not self._dpy:
            return None
        if not self._xss.XScreenSaverQueryInfo(self._dpy, self._root, self._info):
            return None
        return self._info.contents.idle / 1000.0

    def close(self) -> None:
        if getattr(self, "_watcher", None) is not None:
            self._watcher.close()
            self._watcher = None
        if getattr(self, "_info", None):
            self._x.XFree(self._info)
            self._info = None
        if getattr(self, "_dpy", None):
            self._x.XCloseDisplay(self._dpy)
            self._dpy = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass
