"""The worker process: trains one experiment with hivemind, driven by the JSON-lines protocol.

Run as ``dedloc worker`` or ``python -m dedloc_core.worker``. Commands arrive on stdin; events go
to the event channel, which is the original stdout (or ``--event-fd N``). Right at start the
worker points fd 1 at stderr, so a stray ``print`` of a library (or of p2pd) cannot corrupt the
protocol. EOF on stdin means the app is gone: the worker stops as if told to.

Exit codes: 0 stopped cleanly, 1 crashed, 3 a fatal, explained error (bad data, bad experiment).
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import sys
import threading

from . import __version__
from .errors import DedlocError, ProtocolError, WorkerError
from .protocol import (
    MAX_LINE,
    Error,
    Hello,
    Limits,
    Log,
    Pause,
    Progress,
    Resume,
    SetLimits,
    Start,
    State,
    Stats,
    Stop,
    decode_command,
    encode,
)

logger = logging.getLogger(__name__)


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


class _EventLogHandler(logging.Handler):
    """Forwards log records to the app as ``log`` events (WARNING+, and our own INFO)."""

    def __init__(self, channel: EventChannel):
        super().__init__(logging.INFO)
        self.channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        if os.getpid() != self.channel._pid:
            return
        if record.levelno < logging.WARNING and not record.name.startswith("dedloc_core"):
            return
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad log call must not kill training
            message = str(record.msg)
        try:
            # by number, not record.levelname: hivemind renames WARNING to "WARN" (addLevelName)
            self.channel.send(Log(level=_level_name(record.levelno), message=message[:4000], logger=record.name))
        except Exception:  # noqa: BLE001 - an exception here would surface at the caller's log call
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

    def apply(self, command) -> None:
        if isinstance(command, Pause):
            self.pause_reason = command.reason
            self.paused.set()
        elif isinstance(command, Resume):
            self.paused.clear()
        elif isinstance(command, SetLimits):
            update = command.limits.model_dump(exclude_none=True)
            self.limits = self.limits.model_copy(update=update)
            self.limits_changed.set()
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dedloc worker", description=__doc__.splitlines()[0])
    parser.add_argument("--event-fd", type=int, default=None, help="write events to this fd (default stdout)")
    parser.add_argument("--log-level", default=os.environ.get("DEDLOC_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)

    event_fd = args.event_fd if args.event_fd is not None else os.dup(1)
    command_fd = os.dup(0)
    os.dup2(2, 1)  # stray prints (ours, libraries', children's) go to stderr
    sys.stdout = sys.stderr
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # children inherit no command pipe
    os.set_inheritable(event_fd, False)
    channel = EventChannel(event_fd)
    _setup_logging(args.log_level, channel)

    control = Control()
    channel.send(Hello(version=__version__, pid=os.getpid()))
    channel.send(State(state="idle", reason="Waiting for an experiment"))
    reader = threading.Thread(target=read_commands, args=(command_fd, control, channel), daemon=True)
    reader.start()
    return run(control, channel)


def run(control: Control, channel: EventChannel) -> int:
    """Wait for ``start``, train until ``stop``; return the exit code."""
    while True:
        command = control.commands.get()
        if isinstance(command, Stop):
            channel.send(State(state="stopped", reason="Stopped"))
            return 0
        if isinstance(command, Start):
            break
    try:
        check_experiment(command.experiment)  # fail fast, before loading torch and hivemind
        from .training import Session  # imports torch and hivemind

        carried = None
        while True:
            with Session(command, control, channel, carried) as session:
                session.train()
            if not session.rejoin or control.stop.is_set():
                break
            carried = session.totals()  # a fresh session: a new p2pd, the swarm's current state
            command = command.model_copy(update={"start_paused": False})
        channel.send(State(state="stopped", reason="Stopped"))
        return 0
    except DedlocError as exc:
        logger.error("%s: %s", exc.title, exc.message)
        channel.send(Error(code=exc.code, title=exc.title, message=exc.message, fatal=True))
        return 3
    except BaseException as exc:  # noqa: BLE001 - a crash must end with an error event
        logger.exception("Worker crashed")
        err = WorkerError(f"{type(exc).__name__}: {exc}", code="crash")
        channel.send(Error(code=err.code, title=err.title, message=err.message, fatal=True))
        return 1


def check_experiment(experiment: dict) -> None:
    """Raise ``WorkerError(code="bad_experiment")`` unless ``experiment`` is a valid catalog entry.

    The Session checks it again; this check only spares a bad experiment the seconds (and hundreds
    of MB) of importing torch and hivemind before it is reported."""
    import json

    from .catalog import Experiment

    try:
        Experiment.model_validate_json(json.dumps(experiment))
    except ValueError as exc:
        raise WorkerError(f"The experiment description is invalid: {exc}", code="bad_experiment") from exc


def _setup_logging(level: str, channel: EventChannel) -> None:
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setLevel(getattr(logging, level.upper(), logging.INFO))
    stderr.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [worker %(process)d] %(name)s: %(message)s"))
    root.addHandler(stderr)
    root.addHandler(_EventLogHandler(channel))


__all__ = ["main", "run", "Control", "EventChannel", "Stats", "Progress"]

if __name__ == "__main__":
    sys.exit(main())
