"""Seconds since the user last touched the computer, from whatever this desktop offers.

The code is organized as follows:

- ``base``: the ``IdleSource`` interface and ``NullIdle`` (no source: schedule-only contribution).
- ``x11``: the XScreenSaver extension (``libXss``) through ctypes; X11 and XWayland sessions.
- ``x11_input``: XInput 2 raw events (``libXi``) in a thread: input as it happens, for a fast pause.
- ``dbus``: GNOME Mutter's ``IdleMonitor``, ``org.freedesktop.ScreenSaver.GetSessionIdleTime``,
  KDE's screensaver and logind's ``IdleHint``, over D-Bus with jeepney (pure Python).
- ``windows``: ``GetLastInputInfo`` (user32) through ctypes.
- ``macos``: IOKit's ``HIDIdleTime`` through ctypes.

``detect()`` tries the sources that fit this platform in order and returns the first that answers;
``NullIdle`` when none does. A source returns ``None`` when it cannot tell right now: callers treat
that as "the user is present".
"""

from __future__ import annotations

import logging
import sys

from .base import IdleSource, NullIdle
from .dbus import FreedesktopScreenSaverIdle, KdeIdle, LogindIdle, MutterIdle
from .macos import MacIdle
from .windows import WindowsIdle
from .x11 import X11Idle

logger = logging.getLogger(__name__)

__all__ = [
    "IdleSource", "NullIdle", "X11Idle", "MutterIdle", "FreedesktopScreenSaverIdle", "KdeIdle", "LogindIdle",
    "WindowsIdle", "MacIdle", "candidates", "detect",
]


def candidates(platform: str | None = None) -> list[type[IdleSource]]:
    """The source classes worth trying here, best first."""
    platform = platform or sys.platform
    if platform.startswith("win"):
        return [WindowsIdle]
    if platform == "darwin":
        return [MacIdle]
    # Mutter first: on GNOME Wayland an X11 answer would come from XWayland and miss native input
    return [MutterIdle, X11Idle, KdeIdle, FreedesktopScreenSaverIdle, LogindIdle]


def detect(sources: list[type[IdleSource]] | None = None) -> IdleSource:
    """The first source that opens and answers a query; ``NullIdle`` if none does."""
    for cls in sources if sources is not None else candidates():
        try:
            source = cls()
            if source.seconds() is not None:
                logger.info("Idle source: %s", source.name)
                return source
            source.close()
        except Exception as exc:  # any failure means "not this one"
            logger.debug("Idle source %s unavailable: %s", cls.__name__, exc)
    logger.info("No idle source found: contributing on schedule only")
    return NullIdle()
