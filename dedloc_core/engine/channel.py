"""The worker's two channels with the app: events out (``EventChannel``, one JSON line each, and
``EventLogHandler`` for log records) and commands in (``read_commands`` feeding ``Control``).

Light (the protocol and the standard library): the worker opens them before importing torch.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

from dedloc_core.errors import ProtocolError
from dedloc_core.protocol import MAX_LINE, Error, Limits, Log, Pause, Resume, SetLimits, Stop, decode_command, encode

__all__ = ["Control", "EventChannel", "EventLogHandler", "read_commands"]


class EventChannel:
    """Writes events, one line each, from any thread of this process (never from forked children:
    they inherit the fd but must not write to it). A closed pipe sets ``broken``."""

    def __init__(self, fd: int):
        self._fd = fd
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self.broken = threading.Event()

    def send(self, event) -> None:
        if os.getpid() != self._pid:
            return
        data = encode(event).encode("utf-8")
        with self._lock:
            if self.broken.is_set():
                return
            try:
                while data:
                    data = data[os.write(self._fd, data) :]
            except OSError:
                self.broken.set()


class EventLogHandler(logging.Handler):
    """Forwards log records to the app as ``log`` events (WARNING+, and our own INFO)."""

    def __init__(self, channel: EventChannel):
        super().__init__(logging.INFO)
        self.channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        if os.getpid() != self.channel._pid:
            return
        ours = record.name.startswith("dedloc_core")
        if record.levelno < logging.INFO or (record.levelno < logging.WARNING and not ours):
            return
        try:
            message = record.getMessage()
        except Exception:  # a bad log call must not kill training
            message = str(record.msg)
        try:
            # by number, not record.levelname: hivemind renames WARNING to "WARN" (addLevelName)
            self.channel.send(Log(level=_level_name(record.levelno), message=message[:4000], logger=record.name))
        except Exception:  # an exception here would surface at the caller's log call
            self.handleError(record)


def _level_name(levelno: int) -> str:
    for threshold, name in ((logging.CRITICAL, "CRITICAL"), (logging.ERROR, "ERROR"), (logging.WARNING, "WARNING")):
        if levelno >= threshold:
            return name
    return "INFO" if levelno >= logging.INFO else "DEBUG"


class Control:
    """What the command reader tells the training loop. Set from the reader thread."""

    def __init__(self) -> None:
        self.commands: queue.Queue = queue.Queue()
        self.paused = threading.Event()
        self.stop = threading.Event()
        self.pause_reason = ""
        self.limits = Limits()
        self.limits_changed = threading.Event()
        # called with the merged limits as a set_limits arrives (the reader thread): caps take effect
        # at once, not when the training loop next looks (it may be blocked in a round for a minute)
        self.on_limits: Callable[[Limits], None] | None = None

    def apply(self, command) -> None:
        if isinstance(command, Pause):
            self.pause_reason = command.reason
            self.paused.set()
        elif isinstance(command, Resume):
            self.paused.clear()
        elif isinstance(command, SetLimits):
            self.limits = self.limits.merged(command.limits)
            self.limits_changed.set()
            if self.on_limits is not None:
                try:
                    self.on_limits(self.limits)
                except Exception:  # the loop applies them again
                    logging.getLogger(__name__).exception("Applying new limits failed")
        elif isinstance(command, Stop):
            self.stop.set()
        self.commands.put(command)


def read_commands(fd: int, control: Control, channel: EventChannel) -> None:
    """Reader thread: decode commands; report bad ones; EOF means stop.

    Reads the raw fd with os.read: a thread blocked inside ``sys.stdin`` holds its lock, and
    a process forked meanwhile (hivemind forks) would deadlock closing its copy of stdin."""
    pending = b""
    skipping = False  # inside a line already reported as too long: drop it up to its newline
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            break
        if skipping:
            if b"\n" not in chunk:
                continue
            chunk = chunk.split(b"\n", 1)[1]
            skipping = False
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            if line.strip():
                _handle_line(line, control, channel)
        if len(pending) > MAX_LINE:
            channel.send(Error(code="protocol.too_long", title="Protocol error", message="Command line too long."))
            pending = b""
            skipping = True  # its tail is no command of its own
    control.stop.set()
    control.commands.put(Stop())


def _handle_line(line: bytes, control: Control, channel: EventChannel) -> None:
    try:
        command = decode_command(line)
    except ProtocolError as exc:
        channel.send(Error(code=f"protocol.{exc.code}", title=exc.title, message=exc.message))
        return
    control.apply(command)
