"""The idle-source interface, its Null fallback, and loading a C library for the ctypes sources."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable


class IdleUnavailable(Exception):
    """This source does not work on this desktop (raised by a source's constructor)."""


class IdleSource:
    """Seconds since the last user input. ``seconds()`` must be cheap: it runs 4+ times a second."""

    name = "unknown"

    def seconds(self) -> float | None:
        """Seconds since the last input, or None when this source cannot tell right now."""
        raise NotImplementedError

    def watch(self, on_input: Callable[[], None]) -> bool:
        """Have ``on_input()`` called (from another thread) at the first user input after each
        ``arm()``; False where this source cannot tell input as it happens (then only the poll does)."""
        return False

    def arm(self) -> None:
        """Call the watcher's ``on_input`` once, at the next input (nothing without a watcher)."""

    def close(self) -> None:
        """Release what the source holds (a display, a bus connection)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class NullIdle(IdleSource):
    """No source works: the user is taken to be present, so only the schedule decides."""

    name = "no idle source: schedule-only"

    def seconds(self) -> float | None:
        return None


def load_library(names: list[str]) -> ctypes.CDLL:
    """The first of ``names`` that loads (a C library for ctypes), else what find_library finds."""
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    found = ctypes.util.find_library(names[0].split(".")[0].removeprefix("lib"))
    if found:
        return ctypes.CDLL(found)
    raise IdleUnavailable(f"{names[0]} is not installed")
