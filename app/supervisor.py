"""The one object that owns the worker process of the joined experiment.

Start and stop run on a single lifecycle thread (they block: hello handshake, stop with SIGTERM and
SIGKILL of the process group); commands are written to the worker's stdin; events come back as typed
Qt signals on the GUI thread. A worker that exits unexpectedly is restarted with back-off and its
error is shown. A pid file lets the next launch reap a worker left over from a crash of the app.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import psutil
from PySide6.QtCore import QObject, QTimer, Signal

from dedloc_core import paths, proctree, secrets
from dedloc_core.errors import DedlocError, user_message
from dedloc_core.protocol import Error, Hello, Limits, Log, Pause, Progress, Resume, SetLimits, Start, State, Stats
from dedloc_core.workerproc import StopResult, WorkerProcess, remove_socket_dir, where

from .bridge import Bridge

logger = logging.getLogger(__name__)

STARTING = ("idle", "preparing")  # worker states before it joins a swarm
BACKOFF = (2.0, 5.0, 15.0, 60.0, 300.0)  # seconds before restart attempts 1, 2, 3, ...
HEALTHY_AFTER = 60.0  # a worker that trained this long resets the back-off


class Supervisor(QObject):
    hello = Signal(object)
    state = Signal(object)
    progress = Signal(object)
    stats = Signal(object)
    log = Signal(object)
    error = Signal(object)
    running_changed = Signal(bool)
    restart_scheduled = Signal(float)  # seconds until the next start attempt

    def __init__(self, bridge: Bridge, *, pid_file: Path | None = None, env: dict[str, str] | None = None,
                 backoff: tuple[float, ...] = BACKOFF, stop_timeout: float = 20.0, recorder=None,
                 parent: QObject | None = None):
        super().__init__(parent)
        self.bridge = bridge
        self.pid_file = pid_file or paths.data_dir() / "worker.pid"
        self.env = env
        self.backoff = backoff
        self.stop_timeout = stop_timeout
        self.recorder = recorder  # a dedloc_core.stats.recorder.StatsRecorder fed from the reader thread
        self.command: list[str] | None = None  # the worker's own command across a boundary (None: local)
        self.worker: WorkerProcess | None = None
        self._launched: WorkerProcess | None = None  # the last worker started (lifecycle thread only)
        self.wanted: Start | None = None  # the experiment the user joined (None: not joined)
        self.pause_reason: str | None = None
        self.limits: Limits | None = None
        self.failures = 0
        self.last_state: State | None = None  # the current worker's
        self._frozen: WorkerProcess | None = None  # the worker stopped by a pause while it started
        self._generation = 0
        # Events not yet handed to the GUI thread, in order; a Progress or Stats replaces the one of
        # its kind since the last other event (it supersedes it), so a fast worker piles nothing up.
        self._pending: list[tuple[int, object]] = []
        self._pending_lock = threading.Lock()
        self._training_since: float | None = None
        self._lifecycle = ThreadPoolExecutor(max_workers=1, thread_name_prefix="supervisor")
        self._restart = QTimer(self)
        self._restart.setSingleShot(True)
        self._restart.timeout.connect(self._launch)
        self._lifecycle.submit(self.reap_stale)

    # ---- public API (GUI thread) -----------------------------------------------------------

    def join(self, start: Start) -> None:
        """Run ``start`` in a fresh worker (replacing any running one)."""
        self.wanted = start
        self.limits = start.limits
        self.failures = 0
        self._launch()

    def leave(self, done=None) -> None:
        self.wanted = None
        self._restart.stop()
        self._generation += 1
        self._stop_current(done)

    def pause(self, reason: str) -> None:
        self.pause_reason = reason
        self._send(Pause(reason=reason))
        self._freeze_if_starting()

    def resume(self) -> None:
        self.pause_reason = None
        if self._frozen is not None:
            self._frozen.thaw()
            self._frozen = None
        self._send(Resume())

    def _freeze_if_starting(self) -> None:
        """A worker still starting (imports, data, model: before "joining") cannot act on a pause
        for seconds: stop its process until resume. One that joins acts on it at the next hold."""
        worker, state = self.worker, self.last_state
        if worker is not None and self._frozen is None and (state is None or state.state in STARTING):
            if worker.freeze():  # across a boundary no signal reaches it: the pause command holds it
                self._frozen = worker

    def set_limits(self, limits: Limits) -> None:
        if limits != self.limits:
            self.limits = limits
            self._send(SetLimits(limits=limits))

    def running(self) -> bool:
        return self.worker is not None and self.worker.running()

    def where(self) -> str:
        """Where the worker runs (or will run at its next start), in words."""
        return where(self.command)

    def shutdown(self, done=None) -> None:
        """Stop the worker gracefully (kill its process tree after a timeout), then call ``done``."""
        self.leave(done)
        self._lifecycle.shutdown(wait=False)

    # ---- lifecycle (runs on the lifecycle thread) --------------------------------------------

    def _launch(self) -> None:
        if self.wanted is None:
            return
        self._restart.stop()
        self._generation += 1
        generation, start = self._generation, self.wanted
        if self.pause_reason is not None:
            start = msgspec.structs.replace(start, start_paused=True)
        if self.limits is not None:
            start = msgspec.structs.replace(start, limits=self.limits)
        command = self.command
        if command:  # our paths mean nothing there: the worker keeps its identity in its own data folder
            start = msgspec.structs.replace(start, identity_path=None)
        self.worker = self.last_state = self._frozen = None

        def work() -> WorkerProcess | None:
            # the one launched last, even if the GUI thread has not heard of it yet: two workers
            # at once would share the peer identity ("already taken by another peer")
            old, self._launched = self._launched, None
            if old is not None:
                old.stop(timeout=self.stop_timeout)
            self._clear_pid_file()
            if generation != self._generation:  # relaunched or left meanwhile: that one runs
                return None
            if self.recorder is not None:
                self.recorder.begin(start.experiment.get("id", "unknown"))
            sent = _with_invite_code(start) if command else start
            log = _worker_log()
            try:
                worker = WorkerProcess(env=self.env, stderr=log, command=command,
                                       on_event=lambda e: self._from_worker(generation, e))
                worker.start()
            finally:
                log.close()  # the worker holds its own copy
            self._launched = worker
            self._write_pid_file(worker)
            worker.send(sent)
            threading.Thread(target=self._watch, args=(worker, generation), daemon=True,
                             name=f"watch-{worker.pid}").start()
            return worker

        def started(worker: WorkerProcess | None) -> None:
            if worker is None:
                return
            if generation != self._generation:  # left or relaunched meanwhile
                self._lifecycle.submit(worker.stop, self.stop_timeout)
                return
            self.worker = worker
            self.running_changed.emit(True)
            self._sync(start)
            if self.pause_reason is not None:
                self._freeze_if_starting()

        def failed(exc: BaseException) -> None:
            if generation == self._generation:
                self._failed(f"The worker could not start: {user_message(exc).line()}")

        # queued here, in the order of the calls: the bridge's threads start their work in any order,
        # and a relaunch that ran before the one asked earlier was stopped by it ("stopped unexpectedly")
        try:
            launch = self._lifecycle.submit(work)
        except RuntimeError:  # shut down: the app is quitting
            return
        self.bridge.run(launch.result, started, failed)

    def _stop_current(self, done=None) -> None:
        worker, self.worker = self.worker, None
        self._frozen = None  # stop() thaws it
        if worker is not None:
            self.running_changed.emit(False)

        def work() -> StopResult:  # the last one launched: it may not have reached the GUI thread yet
            launched, self._launched = self._launched, None
            result = launched.stop(timeout=self.stop_timeout) if launched is not None else StopResult.NOT_RUNNING
            self._clear_pid_file()
            return result

        future = self._lifecycle.submit(work)
        if done is not None:
            future.add_done_callback(lambda f: self.bridge.post(lambda: done(f.result())))

    def _from_worker(self, generation: int, event: object) -> None:
        """On the worker's reader thread: record, then hand the event to the GUI thread. Progress and
        Stats are coalesced (the GUI shows the latest); every event keeps its order."""
        if self.recorder is not None:
            self.recorder.on_event(event)
        with self._pending_lock:
            schedule = not self._pending
            if isinstance(event, Progress | Stats):
                for i in range(len(self._pending) - 1, -1, -1):
                    kind = type(self._pending[i][1])
                    if kind is type(event):
                        self._pending[i] = (generation, event)
                        return
                    if kind not in (Progress, Stats):
                        break
            self._pending.append((generation, event))
        if schedule:
            self.bridge.post(self._deliver)

    def _deliver(self) -> None:
        with self._pending_lock:
            due, self._pending = self._pending, []
        for generation, event in due:
            self._on_event(generation, event)

    def _watch(self, worker: WorkerProcess, generation: int) -> None:
        assert worker.proc is not None
        code = worker.proc.wait()
        if self.recorder is not None:
            self.recorder.on_event(None)
        self.bridge.post(lambda: self._on_exit(generation, code))

    # ---- events (GUI thread) -----------------------------------------------------------------

    def _on_event(self, generation: int, event: object) -> None:
        if generation != self._generation:
            return
        if isinstance(event, State):
            self.last_state = event
            now = time.monotonic()
            if event.state == "training":
                self._training_since = self._training_since or now
            self.state.emit(event)
        elif isinstance(event, Progress):
            if self._training_since is not None and time.monotonic() - self._training_since > HEALTHY_AFTER:
                self.failures = 0
            self.progress.emit(event)
        elif isinstance(event, Stats):
            self.stats.emit(event)
        elif isinstance(event, Log):
            self.log.emit(event)
        elif isinstance(event, Error):
            self.error.emit(event)
        elif isinstance(event, Hello):
            self.hello.emit(event)

    def _on_exit(self, generation: int, code: int) -> None:
        if generation != self._generation or self.wanted is None:
            return
        self.worker = self._frozen = None
        self._training_since = None
        self.running_changed.emit(False)
        self._failed(f"The worker stopped unexpectedly (exit code {code}).")

    def _failed(self, message: str) -> None:
        delay = self.backoff[min(self.failures, len(self.backoff) - 1)]
        self.failures += 1
        logger.warning("%s Restarting in %.0f s.", message, delay)
        self.error.emit(Error(code="worker_exit", title="Training stopped",
                              message=f"{message} Restarting in {delay:.0f} s.", fatal=False))
        self.restart_scheduled.emit(delay)
        self._restart.start(int(delay * 1000))

    def _send(self, command) -> None:
        if self.worker is not None:
            self.worker.send(command)

    def _sync(self, sent: Start) -> None:
        """Bring a just-started worker up to what changed while it started."""
        if (self.pause_reason is not None) != sent.start_paused:
            self._send(Pause(reason=self.pause_reason or "") if self.pause_reason is not None else Resume())
        if self.limits is not None and self.limits != sent.limits:
            self._send(SetLimits(limits=self.limits))

    # ---- stale workers ------------------------------------------------------------------------

    def _write_pid_file(self, worker: WorkerProcess) -> None:
        try:
            created = psutil.Process(worker.pid).create_time()
            record = {"pid": worker.pid, "create_time": created, "socket_dir": worker.socket_dir}
            paths.atomic_write(self.pid_file, json.dumps(record).encode())
        except (OSError, psutil.Error) as exc:
            logger.warning("Cannot write %s: %s", self.pid_file, exc)

    def _clear_pid_file(self) -> None:
        self.pid_file.unlink(missing_ok=True)

    def reap_stale(self) -> bool:
        """Kill the process group of a worker left by an earlier run of the app, and remove its socket
        folder. True if one was found."""
        try:
            record = json.loads(self.pid_file.read_text())
            pid, created = int(record["pid"]), float(record["create_time"])
        except FileNotFoundError:
            return False
        except (OSError, ValueError, KeyError, TypeError):
            self._clear_pid_file()
            return False
        found = False
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - created) < 0.01:
                logger.warning("Stopping a worker left over from an earlier run (pid %d)", pid)
                if proctree.signal_group(pid, signal.SIGKILL):
                    proc.wait(10)
                    found = True
        except (psutil.Error, ProcessLookupError, PermissionError) as exc:
            logger.info("No stale worker %d: %s", pid, exc)
        proctree.kill_group(pid, timeout=0)
        socket_dir = record.get("socket_dir")
        remove_socket_dir(socket_dir if isinstance(socket_dir, str) else None)  # what the killed group left
        self._clear_pid_file()
        return found


def _with_invite_code(start: Start) -> Start:
    """``start`` with the invite code from this computer's keyring, for a worker across a boundary (it
    cannot read this keyring) in an invite-only experiment; a keyring that fails sends none (the
    worker then says that no code is stored)."""
    experiment = start.experiment
    if not experiment.get("needs_token") or start.invite_code:
        return start
    try:
        code = secrets.get_invite(str(experiment.get("id")))
    except secrets.SecretError as exc:
        logger.warning("%s", exc.message)
        return start
    return msgspec.structs.replace(start, invite_code=code) if code else start


def _worker_log():
    path = paths.log_dir() / "worker.log"
    try:
        if path.exists() and path.stat().st_size > 10 * 2**20:
            path.replace(path.with_suffix(".log.1"))
        return open(path, "a")  # the worker process owns it
    except OSError as exc:
        raise DedlocError(f"Cannot open the worker log {path}: {exc}") from exc
