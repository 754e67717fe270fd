"""macOS idle time: IOKit's ``IOHIDSystem`` property ``HIDIdleTime`` (nanoseconds) through ctypes."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

from .base import IdleSource, IdleUnavailable

_kCFStringEncodingUTF8 = 0x08000100
_kCFNumberSInt64Type = 4


class MacIdle(IdleSource):
    name = "macOS IOKit HIDIdleTime"

    def __init__(self) -> None:
        if sys.platform != "darwin":
            raise IdleUnavailable("not macOS")
        iokit = ctypes.CDLL(ctypes.util.find_library("IOKit"))
        cf = ctypes.CDLL(ctypes.util.find_library("CoreFoundation"))
        iokit.IOServiceMatching.restype = ctypes.c_void_p
        iokit.IOServiceMatching.argtypes = [ctypes.c_char_p]
        iokit.IOServiceGetMatchingService.restype = ctypes.c_uint
        iokit.IOServiceGetMatchingService.argtypes = [ctypes.c_uint, ctypes.c_void_p]
        iokit.IORegistryEntryCreateCFProperty.restype = ctypes.c_void_p
        iokit.IORegistryEntryCreateCFProperty.argtypes = [
            ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        cf.CFStringCreateWithCString.restype = ctypes.c_void_p
        cf.CFStringCreateWithCString.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint]
        cf.CFNumberGetValue.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        cf.CFRelease.argtypes = [ctypes.c_void_p]
        self._iokit, self._cf = iokit, cf
        self._service = iokit.IOServiceGetMatchingService(0, iokit.IOServiceMatching(b"IOHIDSystem"))
        if not self._service:
            raise IdleUnavailable("no IOHIDSystem service")
        self._key = cf.CFStringCreateWithCString(None, b"HIDIdleTime", _kCFStringEncodingUTF8)

    def seconds(self) -> float | None:
        prop = self._iokit.IORegistryEntryCreateCFProperty(self._service, self._key, None, 0)
        if not prop:
            return None
        try:
            value = ctypes.c_int64()
            if not self._cf.CFNumberGetValue(prop, _kCFNumberSInt64Type, ctypes.byref(value)):
                return None
            return value.value / 1e9
        finally:
            self._cf.CFRelease(prop)
