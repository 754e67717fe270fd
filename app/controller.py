"""The app's state and the decisions on it: preferences, catalog, the joined experiment, the user's
pause and snooze, and the status line the tray shows. Views read it and call its methods; it talks
to the worker only through the supervisor. Anything that blocks runs through the bridge."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path

import msgspec
from PySide6.QtCore import QObject, QTimer, Signal

from dedloc_core import autostart, gpu_runtime, joining, prefs, secrets
from dedloc_core.catalog import Experiment, LoadResult, sources
from dedloc_core.catalog import child as catalog_child
from dedloc_core.errors import DedlocError, user_message
from dedloc_core.policy import hardware, idle
from dedloc_core.policy.contributor import Contributor, Pause, ReleaseWorker, Resume, SetLimits, StartWorker
from dedloc_core.policy.idle import NullIdle
from dedloc_core.policy.rules import GPU_COOL_C
from dedloc_core.policy.sampler import Sampler, gpu_probe
from dedloc_core.prefs import Preferences
from dedloc_core.protocol import Error, Limits, Log, Progress, State

from .bridge import Bridge
from .supervisor import Supervisor

logger = logging.getLogger(__name__)

# the worker's Error codes for an invite that does not (or no longer) work: the app leaves and says so
INVITE_ERRORS = ("invite_missing", "invite_unknown", "invite_expired", "invite_revoked", "invite_used_up",
                 "invite_unconfigured")
TICK_MS = 100  # how often the app samples idleness and re-decides (where no input events come)
SLOW_MS = 30_000  # how often statistics and the swarm summary refresh
MAX_LOG = 2000
CATALOG_MS = 6 * 3600 * 1000  # how often the catalog sources are fetched again
CRASH_NOTIFY_AFTER = 3  # failed worker starts in a row before the tray tells the user


@dataclass(frozen=True)
class Status:
    """What the tray shows: a state (picks the icon) and one line for people."""

    state: str  # "idle" | "starting" | "training" | "paused" | "snoozed" | "error" | "stopping"
    text: str


@dataclass(frozen=True)
class GpuSupport:
    """What the "This computer" page says of GPU support ("" where no GPU was found), and whether it
    offers to install it."""

    text: str
    can_install: bool


@dataclass(frozen=True)
class LogEntry:
    time: float
    level: str
    source: str
    message: str


class ControllerView(QObject):
    """What the window reads and calls: the app's signals and state. ``Controller`` is the real one
    (the tray process); ``app.remote.RemoteController`` mirrors it in the window's own process."""

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
    notify = Signal(str, str)  # title, message: what the user should know now (the tray shows it)
    input_seen = Signal()  # the idle source's watcher thread saw user input (delivered in this thread)
    worker_place_changed = Signal(str)  # where the worker runs (worker_place)
    gpu_support_changed = Signal(object)  # GpuSupport: what the "This computer" page says of GPU support
    gpu_reading_changed = Signal(str)  # the GPU's temperature now, for the Contribution page ("": none)

    prefs: Preferences
    prefs_problem: str | None
    catalog: LoadResult | None
    hardware: hardware.Hardware | None
    joined: Experiment | None
    last_progress: Progress | None
    worker_state: State | None
    swarm: object | None
    status: Status
    log_entries: list[LogEntry]
    invite_problems: dict[str, str]  # experiment id -> why its invite no longer works

    def experiment(self, experiment_id: str) -> Experiment | None:
        if self.catalog is None or self.catalog.catalog is None:
            return None
        return self.catalog.catalog.get(experiment_id)

    def origin(self, experiment_id: str) -> str | None:
        """The catalog URL the experiment came from (None: the catalog shipped with the app)."""
        if self.catalog is None:
            return joining.catalog_url()
        return self.catalog.origins.get(experiment_id, joining.catalog_url())

    def source_label(self, experiment_id: str) -> str | None:
        """Who an experiment comes from, for experiments of an added source; None for the built-in one."""
        if self.catalog is None:
            return None
        origin = self.catalog.origins.get(experiment_id)
        state = next((s for s in self.catalog.sources if s.url == origin and not s.builtin), None)
        return state.name or origin if state else None

    def rank(self) -> tuple[int, int] | None:
        """This volunteer's place on the joined swarm's leaderboard: (rank, volunteers), or None."""
        peer_id = self.worker_state.peer_id if self.worker_state is not None else None
        board = self.swarm.leaderboard if self.swarm is not None else []  # type: ignore[attr-defined]
        place = next((i for i, c in enumerate(board, 1) if c.peer_id == peer_id), None)
        return (place, len(board)) if place and peer_id else None


class Controller(ControllerView):
    def __init__(self, bridge: Bridge, supervisor: Supervisor, *, prefs_path: Path | None = None,
                 stats_store=None, sampler: Sampler | None = None, parent: QObject | None = None):
        super().__init__(parent)
        self.bridge, self.supervisor = bridge, supervisor
        self.stats_store = stats_store  # dedloc_core.stats.db.StatsStore, or None when it cannot open
        self.prefs_path = prefs_path
        loaded = prefs.load(prefs_path)
        self.prefs: Preferences = loaded.prefs
        self.prefs_problem = loaded.warning
        self.swarm = None  # the joined swarm's latest SwarmSummary (from its backbone)
        self.catalog: LoadResult | None = None
        self.hardware: hardware.Hardware | None = None
        self.joined: Experiment | None = None
        # The policy: samples idleness, battery, load, schedule; says start / pause / resume / release.
        self.contributor = Contributor(self.prefs, sampler or Sampler(own_pids=self._own_pids))
        self.last_progress: Progress | None = None
        self.worker_state: State | None = None
        self.last_error: Error | None = None
        self.invite_problems: dict[str, str] = {}  # experiment id -> why its invite no longer works
        self.log_entries: list[LogEntry] = []
        self.status = Status("idle", "Not contributing: no experiment joined")
        self._data_server = None
        self._quitting = False
        self._quit_waiters: list = []
        self._quit_done = False

        supervisor.command = self.prefs.worker_argv()
        self.worker_host = ""  # the host name the running worker gave (its hello)
        self._gpu_installing: str | None = None  # what the GPU runtime's install says while it runs
        self._gpu_reading = ""
        supervisor.hello.connect(self._on_hello)
        supervisor.state.connect(self._on_state)
        supervisor.progress.connect(self._on_progress)
        supervisor.log.connect(self._on_log)
        supervisor.error.connect(self._on_error)
        supervisor.running_changed.connect(lambda _: self._update_status())
        supervisor.restart_scheduled.connect(self._on_restart_scheduled)
        supervisor.stats.connect(lambda s: self.contributor.on_stats(s.bytes_sent, s.bytes_received))
        self._tick = QTimer(self)
        self._tick.timeout.connect(self._periodic_tick)
        self._tick.start(TICK_MS)
        self.input_seen.connect(self.tick)  # decide at once: the pause need not wait for the next poll
        self._slow = QTimer(self)  # statistics and the swarm summary
        self._slow.timeout.connect(self.refresh_stats)
        self._slow.start(SLOW_MS)
        self._catalog_timer = QTimer(self)
        self._catalog_timer.timeout.connect(lambda: self.refresh_catalog())
        self._catalog_timer.start(CATALOG_MS)

    # ---- start-up ----------------------------------------------------------------------------

    def start(self, detect_idle: bool = True) -> None:
        """Load what takes time in the background: hardware, the idle source and GPU probe for the
        policy, the catalog (then rejoin)."""
        if self.prefs_problem:
            self.note("WARNING", self.prefs_problem)
        if self.prefs.start_at_login:
            self.sync_autostart()  # the entry may have been removed by hand or by another install
        if detect_idle:
            self.bridge.run(lambda: (idle.detect(), gpu_probe()), self._on_probes,
                            lambda exc: self.fail(exc, doing="Idle detection"))
        self.bridge.run(hardware.probe, self._on_hardware,
                        lambda exc: self.fail(exc, doing="Hardware detection"))
        self.refresh_catalog(rejoin=True)

    def refresh_catalog(self, rejoin: bool = False) -> None:
        url, previous = joining.catalog_url(), self.catalog

        def work() -> LoadResult:  # verified in a child process: no cryptography in the tray
            return catalog_child.load(url or "", previous=previous)

        def done(result: LoadResult) -> None:
            self.catalog = result
            if result.error:
                self.fail(result.error, level="WARNING")
            self.catalog_changed.emit(result)
            self._check_joined_still_runs()
            if rejoin and self.prefs.consent and self.prefs.experiment_id and not self.joined:
                self.join(self.prefs.experiment_id)

        self.bridge.run(work, done, lambda exc: self.fail(exc, doing="Loading the catalog"))

    def _check_joined_still_runs(self) -> None:
        """The organizer finished the joined experiment (or took it out of the catalog): stop and say so."""
        joined = self.joined
        if joined is None or self.catalog is None or self.catalog.catalog is None:
            return
        now = self.catalog.catalog.get(joined.id)
        if now is not None and now.status != "finished":
            return
        self.notify.emit(f"{joined.title} has ended",
                         "Its organizer has finished it, so this computer no longer trains for it. "
                         "Choose another experiment on the Experiments page.")
        self.note("WARNING", f"{joined.title} has ended (the catalog no longer lists it as running); left it.")
        self.leave()

    def _on_restart_scheduled(self, delay: float) -> None:
        if self.supervisor.failures == CRASH_NOTIFY_AFTER:  # once per run of failures
            self.notify.emit("Training keeps stopping",
                             f"The worker stopped {self.supervisor.failures} times in a row; it is tried again "
                             f"in {delay:.0f} s. The event log says why.")

    def _on_probes(self, probes) -> None:
        self.contributor.sampler.idle, self.contributor.sampler.gpu = probes
        self.contributor.sampler.idle.watch(self.input_seen.emit)
        self.note("INFO", f"Idle detection: {self.idle_source_text()}")
        if self.hardware is not None:
            self.hardware_changed.emit(self.hardware)  # the Computer page shows the idle source with it

    def _on_hardware(self, hw: hardware.Hardware) -> None:
        self.hardware = hw
        self.hardware_changed.emit(hw)

    # ---- preferences ---------------------------------------------------------------------------

    def save_prefs(self, new: Preferences) -> None:
        old, self.prefs = self.prefs, new
        self.contributor.prefs = new
        self.prefs_changed.emit(new)
        self.bridge.run(lambda: prefs.save(new, self.prefs_path), None,
                        lambda exc: self.fail(exc, doing="Saving the preferences"))
        if new.start_at_login != old.start_at_login:
            self.sync_autostart()
        if new.worker_command != old.worker_command:
            self.supervisor.command = new.worker_argv()
            self.worker_host = ""
            self.worker_place_changed.emit(self.worker_place())
            if self.supervisor.wanted is not None:  # the running worker moves where it is told
                self.note("INFO", f"Restarting the worker: it runs {self.supervisor.where()} from now on")
                self.supervisor.join(self.supervisor.wanted)
        self.tick()

    def sync_autostart(self) -> None:
        """Make the system's start-at-login entry (XDG autostart, LaunchAgent, Run key) match the
        preference; a failure is shown, the preference stays."""
        on = self.prefs.start_at_login

        def work() -> str:
            entry = autostart.for_platform()
            if entry.enabled() != on:
                entry.set(on)
            return str(entry.where)

        self.bridge.run(work, lambda where: self.note("INFO", f"Start at login {'on' if on else 'off'} ({where})"),
                        lambda exc: self.fail(exc, doing="Start at login"))

    def join_with_invite(self, experiment_id: str, code: str) -> None:
        """Keep the invite code in the keyring (the worker redeems it), then join; a keyring that
        cannot take it is shown and nothing is joined."""
        def stored(_) -> None:
            self.invite_problems.pop(experiment_id, None)
            self.note("INFO", f"Invite code for {experiment_id} stored in the keyring")
            self.join(experiment_id)

        self.bridge.run(lambda: secrets.set_invite(experiment_id, code.strip()), stored,
                        lambda exc: self.fail(exc, doing="Storing the invite code"))

    # ---- catalog sources -------------------------------------------------------------------------

    def add_source(self, url: str, key: str, name: str) -> None:
        """Trust an organizer's catalog (checked in the catalog child before), then load it."""
        try:
            sources.SourceList().add(url, key, name)
        except (DedlocError, OSError, ValueError) as exc:
            self.fail(exc, doing="Adding the catalog source")
            return
        self.note("INFO", f"Added the experiments of {name or url}")
        self.refresh_catalog()

    def remove_source(self, url: str) -> None:
        try:
            removed = sources.SourceList().remove(url)
        except (DedlocError, OSError) as exc:
            self.fail(exc, doing="Removing the catalog source")
            return
        self.note("INFO", f"Removed the experiments of {removed.label()}")
        self.refresh_catalog()

    # ---- join / leave ----------------------------------------------------------------------------

    def join(self, experiment_id: str) -> bool:
        exp = self.experiment(experiment_id)
        if exp is None:
            self.note("ERROR", f"Experiment {experiment_id!r} is not in the catalog.")
            return False
        if exp.status != "active":
            self.note("WARNING", f"{exp.title} is {exp.status}; it cannot be joined now.")
            return False
        if self.joined is not None and self.joined.id == exp.id:
            return True  # already joined (a second click): the worker carries on
        self.joined = exp
        self.last_progress = self.worker_state = self.last_error = None
        self.contributor.worker_released()  # the policy starts the worker when it decides to run
        if self.prefs.experiment_id != exp.id:  # saving ticks the policy: released first, one start
            self.save_prefs(msgspec.structs.replace(self.prefs, experiment_id=exp.id))
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
        self.contributor.worker_released()
        self.save_prefs(msgspec.structs.replace(self.prefs, experiment_id=None))
        self.joined_changed.emit(None)
        self._update_status()

    def _data_url(self, exp: Experiment) -> str | None:
        url = joining.data_base_url(exp, self.origin(exp.id))
        if url is None and not exp.data.base_url:
            url = self._local_data_url()
        return url

    def _local_data_url(self) -> str:
        """No backbone to fetch shards from: serve the corpus shipped with the app on 127.0.0.1."""
        if self._data_server is None:
            from dedloc_core.organizer.httpserve import FileServer

            corpus = resources.files("resources").joinpath("corpus")
            server = FileServer()
            server.serve_dir("/data/", Path(str(corpus)))
            self._data_server = server.start()
        return self._data_server.url

    # ---- pause / snooze ------------------------------------------------------------------------

    def pause(self) -> None:
        self.contributor.pause()
        self.tick()

    def resume(self) -> None:
        self.contributor.resume()
        self.tick()

    def snooze(self, seconds: float = 3600, gpu_only: bool = False) -> None:
        self.contributor.snooze(seconds, gpu_only=gpu_only)
        self.tick()

    def held_by_user(self) -> bool:
        """Paused or snoozed by the user (what Resume undoes)."""
        c, now = self.contributor, datetime.now()
        return c.user_paused or any(until is not None and now < until
                                    for until in (c.snoozed_until, c.gpu_snoozed_until))

    def _own_pids(self) -> list[int]:
        """This app and its worker's process tree: their CPU is not "other programs'"."""
        worker = self.supervisor.worker
        return [os.getpid()] + ([worker.pid] if worker is not None and worker.pid else [])

    def _periodic_tick(self) -> None:
        self.tick()
        if self.contributor.worker == "running":
            # the idle source reports the next input at once (where it can): while the worker trains,
            # that is when the user comes back. Armed here, not on input-driven ticks: at most once a
            # tick, however fast the input comes while the policy keeps training.
            self.contributor.sampler.idle.arm()

    def tick(self) -> None:
        """Ask the policy whether to contribute now and carry out what it says."""
        if self._quitting:
            return
        if self.joined is not None:
            for action in self.contributor.tick():
                if isinstance(action, StartWorker):
                    self._start_worker(action.limits)
                elif isinstance(action, Pause):
                    self.supervisor.pause(action.reason)
                elif isinstance(action, Resume):
                    self.supervisor.resume()
                elif isinstance(action, SetLimits):
                    self.supervisor.set_limits(action.limits)
                elif isinstance(action, ReleaseWorker):
                    self.note("INFO", f"Paused for long ({action.reason}): the worker stops to free memory; "
                                      "it rejoins when contributing resumes")
                    self.supervisor.leave()
        reading = self.gpu_reading()
        if reading != self._gpu_reading:
            self._gpu_reading = reading
            self.gpu_reading_changed.emit(reading)
        self._update_status()

    def gpu_reading(self) -> str:
        """The hottest GPU's temperature the policy last saw, and whether it took the GPU off for it."""
        sample = self.contributor.sample
        temp = sample.gpu_temp_c if sample is not None else None
        if temp is None:
            return ""
        decision, limit = self.contributor.decision, self.prefs.gpu_temp_limit_c
        if decision is not None and decision.gpu_hot and limit is not None:
            return f"GPU at {temp:.0f} °C now: off until it is {limit - GPU_COOL_C} °C"
        return f"GPU at {temp:.0f} °C now"

    def _start_worker(self, limits: Limits) -> None:
        exp = self.joined
        assert exp is not None
        start = joining.start_command(exp, self.prefs, limits=limits, data_url=self._data_url(exp))
        self.supervisor.pause_reason = None
        self.supervisor.command = self.prefs.worker_argv()
        self.supervisor.join(start)

    # ---- worker events ---------------------------------------------------------------------------

    def refresh_stats(self) -> None:
        if self._quitting:
            return
        self.stats_changed.emit()
        url = joining.swarm_summary_url(self.origin(self.joined.id)) if self.joined is not None else None
        if url:
            from dedloc_core.stats.swarmview import fetch_summary

            exp = self.joined
            self.bridge.run(lambda: fetch_summary(url, token=self._member_token(exp)), self._on_swarm,
                            lambda exc: logger.info("No swarm summary: %s", exc))

    @staticmethod
    def _member_token(exp) -> str | None:
        """An invite-only experiment's access token (the worker keeps it in the keyring), sent for the
        members' swarm summary; without it the backbone sends the public one (no peer ids)."""
        if not exp.needs_token:
            return None
        try:
            return secrets.get_token(exp.id)
        except secrets.SecretError as exc:
            logger.info("No access token for the swarm summary: %s", exc.message)
            return None

    def _on_swarm(self, summary) -> None:
        self.swarm = summary
        self.swarm_changed.emit(summary)

    def _on_hello(self, event) -> None:
        self.worker_host = event.host
        self.worker_place_changed.emit(self.worker_place())

    def gpu_support(self) -> GpuSupport:
        """GPU support on this computer: what to say, and whether the page offers to install it."""
        if self._gpu_installing is not None:
            return GpuSupport(self._gpu_installing, False)
        if not self._gpu_found():
            return GpuSupport("", False)
        now = gpu_runtime.current()
        if now is not None:
            return GpuSupport(f"GPU support installed ({now.name})", False)
        offer = self._gpu_offer()
        if offer is None:
            return GpuSupport("GPU found; no GPU support is published for this version of the app: "
                              "training runs on the CPU", False)
        return GpuSupport(f"GPU found; GPU support not installed (download {offer.size / 1e9:.1f} GB)", True)

    def _gpu_found(self) -> bool:
        return self.hardware is not None and bool(self.hardware.gpus)

    @staticmethod
    def _gpu_offer():
        try:
            return gpu_runtime.for_this_machine(gpu_runtime.load_list())
        except gpu_runtime.GpuRuntimeError as exc:
            logger.warning("%s", exc.message)
            return None

    def install_gpu_support(self) -> None:
        """Download and install the GPU runtime in the background; the worker restarts to use it."""
        offer = self._gpu_offer()
        if offer is None or self._gpu_installing is not None:
            return
        self._gpu_installing = f"Installing GPU support ({offer.size / 1e9:.1f} GB)…"
        self.gpu_support_changed.emit(self.gpu_support())
        shown = [0]

        def progress(done: int, total: int) -> None:  # on the bridge's thread
            percent = done * 100 // max(total, 1)
            if percent > shown[0]:
                shown[0] = percent
                text = f"Installing GPU support: {done / 1e9:.2f} of {total / 1e9:.2f} GB"
                self.bridge.post(lambda: self._gpu_progress(text))

        def done(folder) -> None:
            self._gpu_installing = None
            self.note("INFO", f"GPU support installed ({folder.name})")
            self.gpu_support_changed.emit(self.gpu_support())
            if self.supervisor.wanted is not None:  # the worker takes the new torch when it starts
                self.supervisor.join(self.supervisor.wanted)

        def failed(exc: BaseException) -> None:
            self._gpu_installing = None
            self.fail(exc, doing="Installing GPU support")
            self.gpu_support_changed.emit(self.gpu_support())

        self.bridge.run(lambda: gpu_runtime.install(offer, progress=progress), done, failed)

    def _gpu_progress(self, text: str) -> None:
        if self._gpu_installing is not None:
            self._gpu_installing = text
            self.gpu_support_changed.emit(self.gpu_support())

    def worker_place(self) -> str:
        """Where the worker runs, for the window: "this computer", or the command and the host it named."""
        place = self.supervisor.where()
        if self.supervisor.command and self.worker_host:
            place += f" (host {self.worker_host})"
        return place

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
        self.fail(event, source="worker")
        joined = self.joined
        if event.code in INVITE_ERRORS and joined is not None:
            # retrying cannot help: only a new code from the organizer does
            msg = user_message(event)
            self.invite_problems[joined.id] = msg.line()
            self.notify.emit(f"Invite for {joined.title}: {msg.title}", f"{msg.message} {msg.hint}".strip())
            self.leave()
        self._update_status()

    def fail(self, error: object, *, doing: str = "", level: str = "ERROR", source: str = "app") -> None:
        """Log ``error`` (an exception or a worker's ``Error`` event) as the user reads it: one
        translation for all (``errors.user_message``), with what to do."""
        msg = user_message(error)
        text = f"{doing}: {msg.line()}" if doing else msg.line()
        self.note(level, text + (f" What to do: {msg.hint}" if msg.hint else ""), source=source)

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
        decision = self.contributor.decision
        if decision is None:
            return Status("starting", f"Starting {self.joined.title}…")
        if not decision.run:
            reason = decision.reason
            if reason.startswith("Snoozed"):
                return Status("snoozed", reason)
            if not reason.startswith("Paused"):
                reason = f"Paused: {reason[0].lower()}{reason[1:]}"
            return Status("paused", reason)
        if not self.supervisor.running() and self.last_error is not None:
            return Status("error", user_message(self.last_error).line())
        ws = self.worker_state
        if ws is None or ws.state in ("idle", "preparing", "joining"):
            return Status("starting", ws.reason if ws and ws.reason else f"Starting {self.joined.title}…")
        if ws.state == "training":
            sps = self.last_progress.samples_per_second if self.last_progress else 0.0
            text = f"Training {self.joined.recipe} · {sps:.0f} samples/s"
            p = self.last_progress
            if p is not None and p.device and p.device != "CPU":
                text += f" · on {p.device}"
            elif p is not None and p.device_note and (self.supervisor.command or self._gpu_found()):
                text += f" · on the CPU: {p.device_note}"  # a GPU is there (or may be, across a boundary)
            if ws.reachability and ws.reachability != "direct":  # "via relay", "outbound only", "relay lost"
                text += f" · {ws.reachability}"
            if p is not None and p.mode == "diloco" and p.next_sync_in is not None:
                text += " · DiLoCo, " + ("syncing" if p.next_sync_in <= 0 else f"next sync in {p.next_sync_in:.0f} s")
            if decision.reason.startswith("Contributing ("):  # e.g. "you are using the computer: 25% CPU"
                text += " · " + decision.reason[len("Contributing ("):-1]
            return Status("training", text)
        if ws.state == "paused":
            return Status("paused", ws.reason or "Paused")
        return Status("starting", ws.reason or ws.state.title())

    def _update_status(self) -> None:
        status = self._compute_status()
        if status != self.status:
            self.status = status
            self.status_changed.emit(status)

    @property
    def idle_source(self) -> str | None:
        """The idle-detection source in use, or None where none works."""
        source = self.contributor.sampler.idle
        return None if isinstance(source, NullIdle) else source.name

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
        self.contributor.sampler.idle.close()  # (its watcher thread holds a display connection)
        if self._data_server is not None:
            self._data_server.stop()
        self.supervisor.shutdown(lambda _result: self._finish_quit())

    def _finish_quit(self) -> None:
        self._quit_done = True
        waiters, self._quit_waiters = self._quit_waiters, []
        for waiter in waiters:
            waiter()
