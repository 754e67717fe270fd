"""Starting, talking to and stopping a worker process. No Qt: the app's supervisor, the demo and the
tests all use this class.

The worker runs in its own session (process group), so stopping it can take hivemind's helper
processes and p2pd with it: ``stop()`` sends the ``stop`` command, then SIGTERM, then SIGKILL to
the whole group. Its unix sockets go in a folder of its own (``SOCKET_DIR_ENV``), removed with it.

A worker across a boundary (``command``: ``ssh rig dedloc worker``, ``wsl.exe -d DeDLOC -- dedloc
worker``) shares nothing with this side but the protocol on its stdin and stdout: no socket folder
or identity path of ours, no signal (a pause is the ``pause`` command; the process here is only its
launcher), no pid. Its launcher's end of stdout is its death: EOF there is a worker that died, and
EOF on its stdin (the launcher killed here) stops it on the far side.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import IO

from . import environ, proctree
from .errors import ProtocolError, WorkerError
from .proctree import StopResult
from .protocol import PROTOCOL_VERSION, Error, Hello, Stop, decode_event, encode

logger = logging.getLogger(__name__)

def dedloc_command(*args: str) -> list[str]:
    """The command line of ``dedloc ARGS`` in a new process: this frozen executable re-run, or this
    interpreter with ``-m dedloc_core.cli``. Every child process of ours is started through here."""
    if getattr(sys, "frozen", False):
        return [sys.executable, *args]
    return [sys.executable, "-m", "dedloc_core.cli", *args]


def worker_command() -> list[str]:
    """How to start a worker: this interpreter, or this frozen executable re-run with --worker."""
    if getattr(sys, "frozen", False):
        return dedloc_command("--worker")
    return [sys.executable, "-m", "dedloc_core.engine.worker"]


# The folder where the worker's hivemind puts its unix sockets (hivemind_ext.socket_dir): one per
# worker, removed once its process group is gone, so a killed worker leaves no socket file behind.
SOCKET_DIR_ENV = environ.SOCKET_DIR.name
SOCKET_DIR_PREFIX = "dedloc-p2p-"

# Events kept for ``wait_for`` when nobody passed ``on_event``; beyond this the oldest are dropped
# (minutes of a worker's events at the default progress period).
EVENT_BACKLOG = 1000


class WorkerProcess:
    """One worker process. Its events go to ``on_event`` (called from a reader thread) when given;
    otherwise to ``events``, a bounded queue for ``wait_for`` (the oldest are dropped when full).
    Never both: a queue nobody reads would keep every event for as long as the worker lives."""

    def __init__(
        self,
        *,
        env: dict[str, str] | None = None,
        stderr: IO | int | None = None,
        on_event: Callable[[object], None] | None = None,
        extra_args: list[str] | None = None,
        launcher: list[str] | None = None,
        command: list[str] | None = None,
    ):
        self.env = env
        self.stderr = stderr
        self.on_event = on_event
        self.extra_args = extra_args or []
        self.launcher = launcher or []  # a command prefix, e.g. ["ip", "netns", "exec", NS] (it must exec)
        self.command = command or None  # the whole command of a worker across a boundary (module docstring)
        self.events: queue.Queue = queue.Queue(EVENT_BACKLOG)
        self.proc: subprocess.Popen | None = None
        self.hello: Hello | None = None
        self._hello_seen = threading.Event()
        self._lock = threading.Lock()
        self.socket_dir: str | None = None  # ours to remove (SOCKET_DIR_ENV), None if the env named one

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def remote(self) -> bool:
        """Started through a command of its own (across a boundary): only the protocol reaches it."""
        return self.command is not None

    def where(self) -> str:
        """Where the worker runs, in words for the window."""
        return where(self.command)

    def start(self, hello_timeout: float = 30.0) -> Hello:
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.remote:
            env.pop(SOCKET_DIR_ENV, None)  # a path here means nothing there: the worker makes its own
        elif SOCKET_DIR_ENV not in env:
            self.socket_dir = env[SOCKET_DIR_ENV] = tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX)
        try:
            self.proc = subprocess.Popen(
                (self.command or self.launcher + worker_command()) + self.extra_args,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.stderr,
                env=env,
                text=True,
                bufsize=1,
                start_new_session=True,
            )
        except BaseException:  # no process: nobody else would remove the folder
            remove_socket_dir(self.socket_dir)
            self.socket_dir = None
            raise
        threading.Thread(target=self._read_events, name=f"worker-{self.proc.pid}-events", daemon=True).start()
        if not self._hello_seen.wait(hello_timeout) or self.hello is None:
            self.kill()
            raise WorkerError("The worker did not start (no hello).", code="no_hello")
        if self.hello.protocol != PROTOCOL_VERSION:
            self.kill()
            raise WorkerError(f"The worker speaks protocol {self.hello.protocol}, we speak {PROTOCOL_VERSION}.")
        return self.hello

    def _read_events(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = decode_event(line)
            except ProtocolError as exc:
                event = Error(code=f"protocol.{exc.code}", title=exc.title, message=exc.message)
            if isinstance(event, Hello):
                self.hello = event
                self._hello_seen.set()
            if self.on_event is None:
                self._queue(event)
                continue
            try:
                self.on_event(event)
            except Exception:  # a bad callback must not stop the reader
                logger.exception("Event callback failed")
        self._hello_seen.set()
        self._queue(None)  # end of stream

    def _queue(self, event: object) -> None:
        while True:
            try:
                self.events.put_nowait(event)
                return
            except queue.Full:
                try:
                    self.events.get_nowait()  # drop the oldest
                except queue.Empty:
                    pass

    def send(self, command) -> bool:
        """Send one command; False if the worker is gone."""
        return self.send_line(encode(command))

    def send_line(self, line: str) -> bool:
        with self._lock:
            if not self.running() or self.proc is None or self.proc.stdin is None:
                return False
            try:
                self.proc.stdin.write(line if line.endswith("\n") else line + "\n")
                self.proc.stdin.flush()
                return True
            except (BrokenPipeError, OSError, ValueError):
                return False

    def wait_for(self, predicate: Callable[[object], bool], timeout: float) -> object | None:
        """Consume events until one matches; None on timeout or end of stream."""
        if self.on_event is not None:
            raise RuntimeError("wait_for reads the event queue, which an on_event callback replaces")
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                event = self.events.get(timeout=left)
            except queue.Empty:
                return None
            if event is None:
                self._queue(None)
                return None
            if predicate(event):
                return event

    def freeze(self) -> bool:
        """Stop the worker process alone at once (SIGSTOP), as a pause while it starts: importing
        torch and hivemind is seconds of CPU that no pause command can interrupt. Only before it
        joins a swarm: no peer waits on it then, no daemon's timeout runs. ``thaw`` undoes it.
        False where no signal reaches the worker (across a boundary, on Windows): the pause
        command alone holds it, once it reads it."""
        sig = getattr(signal, "SIGSTOP", None)
        if sig is None or self.remote or not self.running():
            return False
        try:
            os.kill(self.proc.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def thaw(self) -> None:
        sig = getattr(signal, "SIGCONT", None)
        if sig is not None and self.proc is not None and not self.remote:
            self._signal_group(sig)

    def stop(self, timeout: float = 20.0, term_timeout: float = 5.0) -> StopResult:
        """Ask the worker to stop; escalate to SIGTERM, then SIGKILL of its whole process group."""
        if self.proc is None or self.proc.poll() is not None:
            self._reap_group()
            return StopResult.NOT_RUNNING
        self.thaw()  # a frozen worker reads no stop command
        self.send(Stop())
        try:
            self.proc.wait(timeout)
            result = StopResult.OK
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(term_timeout)
                result = StopResult.OK
            except subprocess.TimeoutExpired:
                self.kill()
                result = StopResult.KILLED
        self._reap_group()
        return result

    def kill(self) -> None:
        """SIGKILL the worker and everything in its process group (a crash, as seen by the others)."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            return
        remove_socket_dir(self.socket_dir)

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        proctree.signal_group(self.proc.pid, sig)

    def _reap_group(self, timeout: float = 3.0) -> None:
        """Kill whatever is left in the worker's process group (e.g. p2pd after a crash)."""
        if self.proc is None:
            return
        proctree.kill_group(self.proc.pid, timeout)
        remove_socket_dir(self.socket_dir)


def where(command: list[str] | None) -> str:
    """Where a worker started by ``command`` runs (None: the local worker), for the window."""
    if not command:
        return "this computer"
    return "through " + " ".join(command)


def remove_socket_dir(folder: str | None) -> None:
    """Remove a worker's socket folder (``SOCKET_DIR_ENV``) and what its killed processes left in it."""
    if folder and os.path.basename(folder).startswith(SOCKET_DIR_PREFIX):
        shutil.rmtree(folder, ignore_errors=True)
