"""The app's state and the decisions on it: preferences, catalog, the joined experiment, the user's
pause and snooze, and the status line the tray shows. Views read it and call its methods; it talks
to the worker only through the supervisor. Anything that blocks runs through the bridge."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path

from PySide6.QtCore import QObject, QTimer, Signal

from dedloc_core import catalog_child, hardware, joining, prefs, secrets
from dedloc_core.catalog import Experiment, LoadResult
from dedloc_core.prefs import Preferences
from dedloc_core.protocol import Error, Log, Progress, State

from .bridge import Bridge
from .supervisor import Supervisor

logger = logging.getLogger(__name__)

TICK_MS = 250  # how often the app re-decides whether to contribute
SLOW_MS = 30_000  # how often statistics and the swarm summary refresh
MAX_LOG = 2000


@dataclass(frozen=True)
class Status:
    """What the tray shows: a state (picks the icon) and one line for people."""

    state: str  # "idle" | "starting" | "training" | "paused" | "snoozed" | "error" | "stopping"
    text: str


@dataclass(frozen=True)
class LogEntry:
    time: float
    level: str
    source: str
    message: str


class Controller(QObject):
    status_changed = Signal(object)  # Status
    catalog_changed = Signal(object)  # LoadResult
    hardware_changed = Signal(object)  # Hardware
    prefs_changed = Signal(object)  # Preferences
    prefs_warning = Signal(str)
    progress = Signal(object)  # Progress
    logged = Signal(object)  # LogEntry
    joined_changed = Signal(object)  # experiment id or None
    stats_changed = Signal()  # new rows may be in the stats store
    swarm_changed = Signal(object)  # SwarmSummary from the backbone
    peer_id_changed = Signal(object)  # this volunteer's peer id
    quitting = Signal()

    def __init__(self, bridge: Bridge, supervisor: Supervisor, *, prefs_path: Path | None = None,
                 stats_store=None, parent: QObject | None = None):
        super().__init__(parent)
        self.bridge, self.supervisor = bridge, supervisor
        self.stats_store = stats_store  # dedloc_core.statsdb.StatsStore, or None when it cannot open
        self.prefs_path = prefs_path
        loaded = prefs.load(prefs_path)
        self.prefs: Preferences = loaded.prefs
        self.prefs_problem = loaded.warning
        self.catalog: LoadResult | None = None
        self.hardware: hardware.Hardware | None = None
        self.joined: Experiment | None = None
        self.user_paused = False
        self.snooze_until: float | None = None  # wall clock
        self.snooze_gpu_until: float | None = None
        self.last_progress: Progress | None = None
        self.worker_state: State | None = None
        self.last_error: Error | None = None
        self.log_entries: list[LogEntry] = []
        self.status = Status("idle", "Not contributing: no experiment joined")
        self._paused_for: str | None = None  # the pause reason last sent to the worker
        self._data_server = None
        self._quitting = False
        self._quit_waiters: list = []
        self._quit_done = False
        self.idle_source: str | None = None  # set by the policy loop when it finds an idle source

        supervisor.state.connect(self._on_state)
        supervisor.progress.connect(self._on_progress)
        supervisor.log.connect(self._on_log)
        supervisor.error.connect(self._on_error)
        supervisor.running_changed.connect(lambda _: self._update_status())
        self._tick = QTimer(self)
        self._tick.timeout.connect(self.tick)
        self._tick.start(TICK_MS)
        self._slow = QTimer(self)  # statistics and the swarm summary
        self._slow.timeout.connect(self.refresh_stats)
        self._slow.start(SLOW_MS)

    # ---- start-up ----------------------------------------------------------------------------

    def start(self) -> None:
        """Load what takes time in the background: hardware, the catalog (then rejoin)."""
        if self.prefs_problem:
            self.note("WARNING", self.prefs_problem)
        self.bridge.run(hardware.probe, self._on_hardware,
                        lambda exc: self.note("ERROR", f"Hardware detection failed: {exc}"))
        self.refresh_catalog(rejoin=True)

    def refresh_catalog(self, rejoin: bool = False) -> None:
        url = joining.catalog_url()

        def work() -> LoadResult:  # verified in a child process: no cryptography in the tray
            return catalog_child.load(url or "")

        def done(result: LoadResult) -> None:
            self.catalog = result
            if result.error:
                self.note("WARNING", f"{result.error.title}: {result.error.message}")
            self.catalog_changed.emit(result)
            if rejoin and self.prefs.consent and self.prefs.experiment_id and not self.joined:
                self.join(self.prefs.experiment_id)

        self.bridge.run(work, done, lambda exc: self.note("ERROR", f"Loading the catalog failed: {exc}"))

    def _on_hardware(self, hw: hardware.Hardware) -> None:
        self.hardware = hw
        self.hardware_changed.emit(hw)

    # ---- preferences ---------------------------------------------------------------------------

    def save_prefs(self, new: Preferences) -> None:
        self.prefs = new
        self.prefs_changed.emit(new)
        self.bridge.run(lambda: prefs.save(new, self.prefs_path), None,
                        lambda exc: self.note("ERROR", f"Could not save preferences: {exc}"))
        self.tick()

    def store_token(self, experiment_id: str, token: str) -> None:
        self.bridge.run(lambda: secrets.set_token(experiment_id, token),
                        lambda _: self.note("INFO", f"Access token for {experiment_id} stored in the keyring"),
                        lambda exc: self.note("ERROR", str(exc)))

    # ---- join / leave ----------------------------------------------------------------------------

    def experiment(self, experiment_id: str) -> Experiment | None:
        if self.catalog is None or self.catalog.catalog is None:
            return None
        return self.catalog.catalog.get(experiment_id)

    def join(self, experiment_id: str) -> bool:
        exp = self.experiment(experiment_id)
        if exp is None:
            self.note("ERROR", f"Experiment {experiment_id!r} is not in the catalog.")
            return False
        if exp.status != "active":
            self.note("WARNING", f"{exp.title} is {exp.status}; it cannot be joined now.")
            return False
        self.joined = exp
        if self.prefs.experiment_id != exp.id:
            self.save_prefs(self.prefs.model_copy(update={"experiment_id": exp.id}))
        self.last_progress = self.worker_state = self.last_error = None
        self._paused_for = self._pause_reason(time.time())
        if self._paused_for is not None:
            self.supervisor.pause_reason = self._paused_for
        start = joining.start_command(exp, self.prefs, threads=self._threads(), data_url=self._data_url(exp),
                                      limits_now=self._limits(time.time()))
        self.supervisor.join(start)
        self.note("INFO", f"Joined {exp.title}")
        self.joined_changed.emit(exp.id)
        self._update_status()
        return True

    def leave(self) -> None:
        if self.joined is None:
            return
        self.note("INFO", f"Left {self.joined.title}")
        self.joined = None
        self.supervisor.leave()
        self.save_prefs(self.prefs.model_copy(update={"experiment_id": None}))
        self.joined_changed.emit(None)
        self._update_status()

    def _data_url(self, exp: Experiment) -> str | None:
        url = joining.data_base_url(exp, joining.catalog_url())
        if url is None and not exp.data.base_url:
            url = self._local_data_url()
        return url

    def _local_data_url(self) -> str:
        """No backbone to fetch shards from: serve the corpus shipped with the app on 127.0.0.1."""
        if self._data_server is None:
            from dedloc_core.httpserve import FileServer

            corpus = resources.files("resources").joinpath("corpus")
            server = FileServer()
            server.serve_dir("/data/", Path(str(corpus)))
            self._data_server = server.start()
        return self._data_server.url

    # ---- pause / snooze ------------------------------------------------------------------------

    def pause(self) -> None:
        self.user_paused = True
        self.tick()

    def resume(self) -> None:
        self.user_paused = False
        self.snooze_until = self.snooze_gpu_until = None
        self.tick()

    def snooze(self, seconds: float = 3600, gpu_only: bool = False) -> None:
        until = time.time() + seconds
        if gpu_only:
            self.snooze_gpu_until = until
        else:
            self.snooze_until = until
        self.tick()

    def _pause_reason(self, now: float) -> str | None:
        if self.user_paused:
            return "Paused by you"
        if self.snooze_until is not None:
            if now < self.snooze_until:
                return f"Snoozed until {_hhmm(self.snooze_until)}"
            self.snooze_until = None
        return None

    def _threads(self) -> int:
        return self.hardware.threads if self.hardware else 1

    def _limits(self, now: float):
        gpu_snoozed = self.snooze_gpu_until is not None and now < self.snooze_gpu_until
        return joining.limits(self.prefs, self._threads(), gpu_allowed=not gpu_snoozed)

    def tick(self) -> None:
        """Decide whether to contribute now and tell the worker when that changes."""
        if self._quitting:
            return
        now = time.time()
        reason = self._pause_reason(now)
        if self.joined is not None:
            if reason != self._paused_for:
                self._paused_for = reason
                if reason is None:
                    self.supervisor.resume()
                else:
                    self.supervisor.pause(reason)
            self.supervisor.set_limits(self._limits(now))
        self._update_status()

    # ---- worker events ---------------------------------------------------------------------------

    def refresh_stats(self) -> None:
        if self._quitting:
            return
        self.stats_changed.emit()
        url = joining.swarm_summary_url()
        if url and self.joined is not None:
            from dedloc_core.swarmview import fetch_summary

            self.bridge.run(lambda: fetch_summary(url), self.swarm_changed.emit,
                            lambda exc: logger.info("No swarm summary: %s", exc))

    def _on_state(self, event: State) -> None:
        if event.peer_id and (self.worker_state is None or self.worker_state.peer_id != event.peer_id):
            self.peer_id_changed.emit(event.peer_id)
        self.worker_state = event
        if event.state == "training":
            self.last_error = None
        self._update_status()

    def _on_progress(self, event: Progress) -> None:
        self.last_progress = event
        self.progress.emit(event)
        self._update_status()

    def _on_log(self, event: Log) -> None:
        self.note(event.level, event.message, source=event.logger or "worker")

    def _on_error(self, event: Error) -> None:
        self.last_error = event
        self.note("ERROR", f"{event.title}: {event.message}", source="worker")
        self._update_status()

    def note(self, level: str, message: str, source: str = "app") -> None:
        entry = LogEntry(time.time(), level, source, message)
        self.log_entries.append(entry)
        del self.log_entries[:-MAX_LOG]
        getattr(logger, level.lower(), logger.info)("%s: %s", source, message)
        self.logged.emit(entry)

    # ---- status --------------------------------------------------------------------------------

    def _compute_status(self) -> Status:
        if self._quitting:
            return Status("stopping", "Stopping the worker…")
        if self.joined is None:
            return Status("idle", "Not contributing: no experiment joined")
        reason = self._paused_for
        if reason is not None:
            return Status("snoozed" if reason.startswith("Snoozed") else "paused", reason)
        if not self.supervisor.running() and self.last_error is not None:
            return Status("error", f"{self.last_error.title}: {self.last_error.message}")
        ws = self.worker_state
        if ws is None or ws.state in ("idle", "preparing", "joining"):
            return Status("starting", ws.reason if ws and ws.reason else f"Starting {self.joined.title}…")
        if ws.state == "training":
            sps = self.last_progress.samples_per_second if self.last_progress else 0.0
            text = f"Training {self.joined.recipe} · {sps:.0f} samples/s"
            if self.snooze_gpu_until and time.time() < self.snooze_gpu_until:
                text += f" · GPU snoozed until {_hhmm(self.snooze_gpu_until)}"
            return Status("training", text)
        if ws.state == "paused":
            return Status("paused", ws.reason or "Paused")
        return Status("starting", ws.reason or ws.state.title())

    def _update_status(self) -> None:
        status = self._compute_status()
        if status != self.status:
            self.status = status
            self.status_changed.emit(status)

    def idle_source_text(self) -> str:
        return self.idle_source or "None found: the app treats you as present (schedule-only)"

    # ---- quit ------------------------------------------------------------------------------------

    def quit(self, done) -> None:
        """Stop the worker (gracefully, then its whole process tree), then call ``done``."""
        if self._quit_done:
            done()
            return
        self._quit_waiters.append(done)
        if self._quitting:
            return
        self.quitting.emit()
        self._quitting = True
        self._update_status()
        self._tick.stop()
        self._slow.stop()
        if self._data_server is not None:
            self._data_server.stop()
        self.supervisor.shutdown(lambda _result: self._finish_quit())

    def _finish_quit(self) -> None:
        self._quit_done = True
        waiters, self._quit_waiters = self._quit_waiters, []
        for waiter in waiters:
            waiter()


def _hhmm(wall: float) -> str:
    return datetime.fromtimestamp(wall).strftime("%H:%M")

