"""The idle-source interface and its Null fallback."""

from __future__ import annotations


class IdleUnavailable(Exception):
    """This source does not work on this desktop (raised by a source's constructor)."""


class IdleSource:
    """Seconds since the last user input. ``seconds()`` must be cheap: it runs 4+ times a second."""

    name = "unknown"

    def seconds(self) -> float | None:
        """Seconds since the last input, or None when this source cannot tell right now."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the source holds (a display, a bus connection)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


class NullIdle(IdleSource):
    """No source works: the user is taken to be present, so only the schedule decides."""

    name = "no idle source: schedule-only"

    def seconds(self) -> float | None:
        return None
