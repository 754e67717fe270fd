"""User input as it happens on X11: XInput2 raw events (``libXi``) read by a thread of their own.

The policy's poll of the idle time (``X11Idle.seconds``, every 100 ms) puts a floor under how fast
contributing pauses when the user comes back. An armed ``InputWatcher`` calls ``on_input`` at the
first key, button or pointer motion instead, and disarms itself: while disarmed it selects no
events, so a user at work costs nothing; the app arms it again while it trains.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import threading
from collections.abc import Callable

from .base import IdleUnavailable, load_library

logger = logging.getLogger(__name__)

XI_ALL_MASTER_DEVICES = 1
# XI_RawKeyPress, XI_RawButtonPress, XI_RawMotion (XI2/XI2.h); releases add nothing
RAW_EVENTS = (13, 15, 17)
MASK_BYTES = 4  # (XI_LASTEVENT + 7) / 8
GENERIC_EVENT = 35


class _EventMask(ctypes.Structure):
    _fields_ = [("deviceid", ctypes.c_int), ("mask_len", ctypes.c_int), ("mask", ctypes.POINTER(ctypes.c_ubyte))]


class _Cookie(ctypes.Structure):  # XGenericEventCookie, enough of it to tell whose event it is
    _fields_ = [("type", ctypes.c_int), ("serial", ctypes.c_ulong), ("send_event", ctypes.c_int),
                ("display", ctypes.c_void_p), ("extension", ctypes.c_int), ("evtype", ctypes.c_int)]


class _Event(ctypes.Union):  # XEvent: 24 longs
    _fields_ = [("cookie", _Cookie), ("pad", ctypes.c_long * 24)]


class InputWatcher:
    """Calls ``on_input()`` (from its own thread) at the first user input after ``arm()``."""

    def __init__(self, x11: ctypes.CDLL, display: str, on_input: Callable[[], None]):
        self._x, self._on_input = x11, on_input
        self._xi = load_library(["libXi.so.6", "libXi.dylib"])
        self._x.XQueryExtension.argtypes = [ctypes.c_void_p, ctypes.c_char_p] + [ctypes.POINTER(ctypes.c_int)] * 3
        self._x.XConnectionNumber.argtypes = [ctypes.c_void_p]
        self._x.XPending.argtypes = [ctypes.c_void_p]
        self._x.XNextEvent.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Event)]
        self._x.XFlush.argtypes = [ctypes.c_void_p]
        self._xi.XIQueryVersion.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        self._xi.XISelectEvents.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.POINTER(_EventMask), ctypes.c_int]
        self._dpy = self._x.XOpenDisplay(display.encode())  # its own connection: Xlib's are not shared by threads
        if not self._dpy:
            raise IdleUnavailable(f"cannot open X display {display}")
        opcode, event, error = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        major, minor = ctypes.c_int(2), ctypes.c_int(2)  # 2.1+: raw events reach every client that selects them
        if (not self._x.XQueryExtension(self._dpy, b"XInputExtension", ctypes.byref(opcode), ctypes.byref(event),
                                        ctypes.byref(error))
                or self._xi.XIQueryVersion(self._dpy, ctypes.byref(major), ctypes.byref(minor)) != 0):
            self._x.XCloseDisplay(self._dpy)
            raise IdleUnavailable(f"X display {display} lacks XInput 2")
        self._opcode = opcode.value
        self._root = self._x.XDefaultRootWindow(self._dpy)
        self._wake_r, self._wake_w = os.pipe()
        self._want = threading.Event()  # armed, as asked; the thread selects events to match
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="x11-input", daemon=True)
        self._thread.start()

    def arm(self) -> None:
        """Call ``on_input`` once, at the next input."""
        if not self._want.is_set() and not self._closed:
            self._want.set()
            os.write(self._wake_w, b"a")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        os.write(self._wake_w, b"q")
        self._thread.join(5)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _select(self, on: bool) -> None:
        bits = (ctypes.c_ubyte * MASK_BYTES)()
        for event in RAW_EVENTS if on else ():
            bits[event >> 3] |= 1 << (event & 7)
        mask = _EventMask(XI_ALL_MASTER_DEVICES, MASK_BYTES, bits)
        self._xi.XISelectEvents(self._dpy, self._root, ctypes.byref(mask), 1)
        self._x.XFlush(self._dpy)

    def _run(self) -> None:
        fd, selected, event = self._x.XConnectionNumber(self._dpy), False, _Event()
        try:
            while not self._closed:
                if self._want.is_set() != selected:
                    selected = self._want.is_set()
                    self._select(selected)
                ready, _, _ = select.select([fd, self._wake_r], [], [])
                if self._wake_r in ready:
                    os.read(self._wake_r, 64)
                seen = False
                while self._x.XPending(self._dpy):
                    self._x.XNextEvent(self._dpy, ctypes.byref(event))
                    seen |= event.cookie.type == GENERIC_EVENT and event.cookie.extension == self._opcode
                if seen and selected and self._want.is_set():
                    self._want.clear()  # disarmed: deselected at the top of the loop
                    try:
                        self._on_input()
                    except Exception:  # the caller's bug: keep watching
                        logger.exception("Input callback failed")
        except Exception:  # the display went away: the poll still decides, only later
            logger.exception("X11 input watcher stopped")
        finally:
            self._x.XCloseDisplay(self._dpy)
