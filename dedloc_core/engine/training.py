"""One training session inside the worker: data, recipe, DHT, Optimizer and the training loop.

Imports torch and hivemind; only the worker process imports this module.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import psutil
import torch

from dedloc_core import environ, gpu_runtime, paths, proctree
from dedloc_core.catalog.model import Experiment, experiment_from
from dedloc_core.errors import WorkerError
from dedloc_core.protocol import Progress, Start, State, Stats

from . import bans, gate, hivemind_ext, invited, limits, metrics, prefetch, reachability, robust, swarm
from .channel import Control, EventChannel
from .dht_fallback import DhtFallback
from .diloco import DilocoOptimizer
from .reachability import RELAY_LOST, VIA_RELAY, only_loopback
from .recipes import load_recipe
from .shard_cache import fetch_in_background

logger = logging.getLogger(__name__)

# A peer's metrics record in the DHT (the backbone's learning curve and leaderboard): one for each new
# global step, at most every METRICS_GAP seconds, and every METRICS_PERIOD seconds between steps. At
# one every 5 s they were a fifth of a volunteer's DHT stores, each a search and a store on every node.
METRICS_GAP, METRICS_PERIOD = 5.0, 30.0


def metrics_due(published: tuple[int, float], epoch: int, now: float) -> bool:
    """Whether a peer at local ``epoch`` publishes its metrics at ``now``; ``published``: the (local
    epoch, time) of its last record."""
    last_epoch, last = published
    return now - last >= METRICS_PERIOD or (epoch != last_epoch and now - last >= METRICS_GAP)


class Session:
    """Owns the DHT, the Optimizer and the model of one experiment; stops them on exit."""

    def __init__(self, start: Start, control: Control, channel: EventChannel, carried: dict | None = None,
                 shards: Future | None = None, new_identity: bool = False):
        self.start, self.control, self.channel = start, control, channel
        self._shards = shards  # the data, already being fetched (``fetch_in_background``), or None
        self._new_identity = new_identity  # the identity file was written by the data fetch (invited.data_token)
        self.dht = self.optimizer = self.model = None
        carried = carried or {}  # the totals of an earlier session of this worker (see ``rejoin``)
        self.samples = carried.get("samples", 0)  # computed; ``counted`` is the contribution
        self._carried_dropped = carried.get("samples_dropped", 0)
        self._counted = carried.get("counted", 0)
        self.compute_seconds = carried.get("compute_seconds", 0.0)
        self.paused_seconds = carried.get("paused_seconds", 0.0)
        self._carried_rounds = carried.get("rounds", 0)
        self._carried_averaging = carried.get("averaging_seconds", 0.0)
        self.rejoin = False  # set when this session ends only to start a fresh one (a lost relay)
        self.loss_ema: float | None = None
        self._window = (time.monotonic(), self.samples, self.compute_seconds)  # at the last progress
        self._digest: tuple[tuple[int, int], list[float]] = ((-1, 0), [])  # ((epoch, resyncs), digest)
        self._reported_epoch = -1  # the local epoch of the last progress report
        self._published = (-1, float("-inf"))  # (local epoch, monotonic time) of the last metrics record
        self.on_gpu = False

    # ---- setup / teardown -------------------------------------------------------------------

    def __enter__(self) -> Session:
        exp = self.experiment = self._read_experiment()
        clock = _Phases()
        shard_paths = self._fetch_data()
        clock.lap("data")
        self._prepare_process()
        self._build_model(shard_paths)
        clock.lap("model")
        self._hold_while_paused("preparing", f"Preparing {exp.title}")  # paused while starting: join later
        self._state("joining", f"Joining the swarm of {exp.title}")
        cfg = self._swarm_config()
        download = self._join(cfg, clock)
        self._build_optimizer(cfg, download, clock)
        self.on_gpu = self._on_gpu()
        self.gate = limits.PauseGate(self._should_hold, self._pause)
        self.gate.attach(self.model)  # pauses inside forward and backward, not only between batches
        self.peer_id = str(self.dht.peer_id)
        self.maddrs = [str(m) for m in self.dht.get_visible_maddrs(latest=True)]
        clock.lap("state" if exp.mode != "diloco" else "optimizer")
        logger.info("Joined run %s as %s", exp.run_id, self.peer_id)
        logger.info("Ready to train %s", clock)
        self._start_watchers(cfg)
        return self

    def _read_experiment(self) -> Experiment:
        try:
            return experiment_from(self.start.experiment)
        except ValueError as exc:
            raise WorkerError(f"The experiment description is invalid: {exc}", code="bad_experiment") from exc

    def _fetch_data(self) -> list:
        """The paths of the experiment's shards, once fetched (the worker may have begun already)."""
        exp = self.experiment
        if self._shards is None:
            self._state("preparing", f"Fetching data for {exp.title}")
            self._shards = fetch_in_background(exp.data.files(), self.start.data_base_url or exp.data.base_url,
                                               invited.data_token(exp, self._identity_path(), self.start.invite_code))
        return self._shards.result()

    def _prepare_process(self) -> None:
        """Process-wide setup, before hivemind forks and torch starts threads."""
        exp = self.experiment
        swarm.prepare_process()
        swarm.p2pd_on_one_thread()
        robust.configure(exp.aggregation, exp.clip_radius, exp.clip_iterations)  # before hivemind forks
        bans.load(exp.run_id)  # the worker's ban list, shared with the forks and kept across restarts
        self._apply_limits()
        self.control.on_limits = functools.partial(limits.apply_network_over, self.start.limits)

    def _build_model(self, shard_paths: list) -> None:
        """The recipe, its model (on the GPU if the limits allow it) and the batches over our shards."""
        exp = self.experiment
        n = len(exp.data.shards)  # the tokenizer, if any, comes after the shards (DataSource.files)
        shard_paths, tokenizer = shard_paths[:n], (shard_paths[n] if len(shard_paths) > n else None)
        self.recipe = load_recipe(exp.recipe, exp.recipe_params, tokenizer)
        self.model = self.recipe.build_model(seed=0)
        if limits.gpu_wanted(self.limits):  # the device is chosen once; use_gpu=False later pauses
            self.model.to("cuda")
        self.batch_size = self.start.batch_size or exp.batch_size_per_step
        self.batches = self.recipe.batches(shard_paths, self.batch_size, seed=self.start.seed)
        self.torch = torch

    def _identity_path(self) -> str:
        return self.start.identity_path or str(paths.data_dir() / "identity.key")  # stable peer id

    def _swarm_config(self) -> swarm.SwarmConfig:
        """The experiment's swarm settings with this worker's own (addresses, identity, limits)."""
        exp = self.experiment
        identity_path = self._identity_path()
        return swarm.config_for(
            exp, role="volunteer",
            batch_size_per_step=self.batch_size,
            initial_peers=self.start.initial_peers if self.start.initial_peers is not None else exp.initial_peers,
            host_maddrs=self.start.host_maddrs,
            announce_maddrs=self.start.announce_maddrs,
            identity_path=identity_path,
            identity_is_new=self._new_identity or not os.path.isfile(identity_path),
            client_mode=self.start.client_mode,
            bandwidth=self.start.bandwidth or limits.bandwidth_hint(self.limits),
            grad_compression=self.start.grad_compression or "fp16",
            reachability=self.start.reachability,
        )

    def _join(self, cfg: swarm.SwarmConfig, clock: _Phases) -> Future | None:
        """Join the swarm (an invite-only experiment's token first): sets ``dht``, ``reachability``
        and ``public_key``; returns the download of the swarm's state begun meanwhile, or None."""
        exp = self.experiment
        metrics.use_identity_key(cfg.identity_path)  # records signed by the key that names this peer
        token = None
        if exp.needs_token:  # invite-only: a token from the backbone, checked by every peer (gate.py)
            token, identity = invited.obtain(exp, cfg.identity_path, self.start.invite_code)
            gate.configure(exp.run_id, exp.invite_key)  # before hivemind forks the DHT and averagers
            self.token_holder = gate.TokenHolder(token)
            cfg.authorizer = gate.InviteAuthorizer(metrics.load_identity_key(cfg.identity_path), self.token_holder)
        else:
            gate.disable()
        self.dht, self.reachability = swarm.join_swarm(cfg, on_start=functools.partial(self._on_dht, cfg, token))
        clock.lap("swarm")
        logger.info("Reachability: %s", self.reachability)
        self.public_key, download = self._joined  # set for the DHT that stayed: the last one started
        if exp.needs_token:
            self.renewer = invited.Renewer(exp, identity, self.token_holder,
                                           lambda t: gate.publish(self.dht, t, subkey=self.public_key))
            self.ban_reporter = bans.Reporter(exp.invite_url, identity, exp.run_id)  # peers we ban, to the organizer
        return download

    def _build_optimizer(self, cfg: swarm.SwarmConfig, download: Future | None, clock: _Phases) -> None:
        """The experiment's optimizer; a synchronous swarm's newcomer then loads the swarm's state."""
        exp = self.experiment
        if exp.mode == "diloco":
            self.optimizer = DilocoOptimizer(
                self.dht, exp.run_id, self.model, self.recipe, exp.diloco, batch_size=self.batch_size,
                matchmaking_time=exp.matchmaking_time, averaging_timeout=exp.averaging_timeout,
                client_mode=swarm.averaging_client_mode(self.dht))
            self.param_digest = lambda _model: self.optimizer.outer_digest()  # identical on synced peers
            return
        self._hold_while_paused("joining", f"Joining the swarm of {exp.title}")  # seconds of CPU
        self.optimizer = swarm.build_optimizer(self.dht, cfg, self.model, self.recipe)
        self.param_digest = swarm.param_digest
        if environ.IDLE_LOOP.flag():
            limits.training_below_helpers()  # its DHT and averagers are forked by now
        clock.lap("optimizer")
        self._catch_up(download)

    def _start_watchers(self, cfg: swarm.SwarmConfig) -> None:
        """The watchdog that finds the swarm again after an outage, and the DHT fallback."""
        # on loopback no link goes down; elsewhere a watchdog finds the swarm again after an outage
        self._watchdog = Watchdog(self.dht, [] if only_loopback(cfg.host_maddrs) else cfg.initial_peers,
                                  relayed=self.reachability == VIA_RELAY)
        # a volunteer that only uses the DHT serves it while no backbone answers
        self._dht_fallback = DhtFallback(
            self.dht, cfg.initial_peers if getattr(self.dht, "dedloc_dht_client", False) else [],
            lost_since=(lambda: self._watchdog.lost_since) if self._watchdog.peers else None)
        self._relay_ok_reported = True

    def _on_dht(self, cfg, token: str | None, dht) -> None:
        """A DHT is up (``reachability.join`` may still find it unreachable and start another):
        its record validators, our invite token and, for a newcomer, the download of the swarm's
        state, begun now so that it runs while the dial-back and the optimizer take their seconds
        (with no initial peers we are the swarm's first: nothing to load)."""
        exp = self.experiment
        public_key = metrics.add_validators(dht, exp.run_id)
        if token is not None:
            gate.publish(dht, token, subkey=public_key)  # the peers serving the state check it
        download = None
        if cfg.initial_peers and exp.mode != "diloco":
            download = prefetch.start(dht, exp.run_id, cfg.load_state_timeout)
        self._joined = (public_key, download)

    def _catch_up(self, state) -> None:
        """A swarm already past our step: load its state now, before any gradients are computed.
        hivemind would find out only after its first fetch of the swarm's progress, at a step, and
        throw that micro-batch away; its tracker read the swarm's step once at start already.
        ``state``: the download begun while the optimizer was built (``prefetch.start``), or None."""
        opt = self.optimizer
        swarm_step = opt.tracker.global_epoch
        if swarm_step <= opt.local_epoch:
            if state is not None:
                state.cancel()
            return  # alone, or the first: nothing to wait for
        self._state("joining", f"Loading the swarm's state (step {swarm_step})")
        began, before = time.monotonic(), opt.local_epoch
        opt.state_averager.prefetched, opt.state_averager.min_epoch = state, swarm_step - 1
        opt.load_state_from_peers()
        logger.info("Loaded the swarm's state in %.1f s (step %d -> %d, %s)", time.monotonic() - began, before,
                    opt.local_epoch, "downloaded while joining" if opt.state_averager.used_prefetched
                    else "downloaded now")

    def _hold_while_paused(self, state: str, reason: str) -> None:
        """Between the steps of joining: wait, using no CPU, while the app says pause; then say
        ``state`` again."""
        control = self.control
        if not control.paused.is_set() or control.stop.is_set():
            return
        self._state("paused", control.pause_reason or "Paused")
        while control.paused.is_set() and not control.stop.is_set():
            control.stop.wait(0.05)
        self._state(state, reason)

    def __exit__(self, *exc) -> None:
        if self.rejoin:  # only restarting: the worker is not going away
            self._state("joining", "Reconnecting to the backbone's relay")
        else:
            self._state("stopping", "Leaving the swarm")
        for watcher in (getattr(self, "_watchdog", None), getattr(self, "_dht_fallback", None)):
            if watcher is not None:
                watcher.stop()
        if getattr(self, "renewer", None) is not None:
            self.renewer.stop()
        if getattr(self, "ban_reporter", None) is not None:
            self.ban_reporter.stop()
        for obj in (self.optimizer, self.dht):
            if obj is not None:
                try:
                    obj.shutdown()
                except Exception:  # keep tearing down
                    logger.exception("Shutdown of %s failed", type(obj).__name__)
        kill_children()

    def _apply_limits(self) -> None:
        self.control.limits_changed.clear()
        self.limits = limits.merged(self.start.limits, self.control.limits)
        limits.apply_cpu_and_network(self.limits)
        limits.apply_gpu_memory_cap(self.limits)

    def _should_hold(self) -> bool:
        """Paused by the app, or on a GPU that the limits now forbid."""
        if self.control.limits_changed.is_set():
            self._apply_limits()
        if self.control.stop.is_set():
            return False
        return self.control.paused.is_set() or (self.on_gpu and self.limits.use_gpu is False)

    def dropped(self) -> int:
        """Samples a state load dropped before they reached a step (a newcomer late to the swarm's
        first step, a peer far behind): computed, but not part of the swarm's training."""
        return self._carried_dropped + getattr(self.optimizer, "samples_dropped", 0)

    def counted(self) -> int:
        """The samples this volunteer contributed (its metrics record), never less than the last
        figure: drops already published are taken off the samples that follow."""
        self._counted = max(self._counted, self.samples - self.dropped())
        return self._counted

    def totals(self) -> dict:
        """What a follow-up session carries on: the Stats totals are per worker process."""
        opt = self.optimizer
        return dict(samples=self.samples, samples_dropped=self.dropped(), counted=self.counted(),
                    compute_seconds=self.compute_seconds, paused_seconds=self.paused_seconds,
                    rounds=self._carried_rounds + (opt.rounds_joined if opt is not None else 0),
                    averaging_seconds=self._carried_averaging + (opt.averaging_seconds if opt is not None else 0.0))

    def _state(self, state: str, reason: str) -> None:
        peer_id = getattr(self, "peer_id", None)
        self.channel.send(State(state=state, reason=reason, peer_id=peer_id, maddrs=getattr(self, "maddrs", []),
                                reachability=self._reachability()))

    def _reachability(self) -> str | None:
        """How others reach us now: as joined, unless the relay reservation we joined with is lost."""
        reach, watchdog = getattr(self, "reachability", None), getattr(self, "_watchdog", None)
        if reach == VIA_RELAY and watchdog is not None and not watchdog.relay_ok:
            return RELAY_LOST
        return reach

    # ---- the loop ----------------------------------------------------------------------------

    def train(self) -> None:
        """Train until stop; pause between micro-batches when told to."""
        control = self.control
        if self.start.start_paused:
            control.paused.set()
        self._say_training()
        next_report = time.monotonic() + self.start.progress_period
        watch = StepWatch(control, lambda: self._state("paused", control.pause_reason or "Paused"),
                          self._say_training)
        try:
            self._loop(watch, next_report)
        finally:
            watch.close()
        self._report()

    def _loop(self, watch: StepWatch, next_report: float) -> None:
        control, opt = self.control, self.optimizer
        while not control.stop.is_set() and not self.channel.broken.is_set():
            reported = watch.take()  # the watch said "paused" while opt.step() was blocked
            if self._should_hold():
                self._pause(reported=reported)
                next_report = time.monotonic()
                continue
            if reported:  # paused and resumed within one blocked step
                self._say_training()
            if self._watchdog.rejoined.is_set():
                with watch:  # a state download: seconds on a slow link
                    self._reload_state()
            if getattr(self, "renewer", None) is not None and self.renewer.failure is not None:
                raise self.renewer.failure  # revoked: the worker's Error event says so
            if self._watchdog.relay_gone():
                logger.warning("The relay reservation is gone and p2pd does not renew it: rejoining the swarm")
                self.rejoin = True
                break
            began = time.perf_counter()
            batch = next(self.batches)
            loss = self.recipe.loss(self.model, batch)
            loss.backward()
            with watch:
                opt.step()
            opt.zero_grad()
            self.compute_seconds += time.perf_counter() - began
            self.samples += self.batch_size
            value = float(loss.detach())
            if math.isfinite(value):
                self.loss_ema = value if self.loss_ema is None else 0.9 * self.loss_ema + 0.1 * value
            if self._watchdog.relay_ok != self._relay_ok_reported:  # the relay went or came back
                self._relay_ok_reported = self._watchdog.relay_ok
                self._say_training()
            if time.monotonic() >= next_report or opt.local_epoch != self._reported_epoch:
                self._report()  # periodically, and at every new global step
                next_report = time.monotonic() + self.start.progress_period

    def _reload_state(self) -> None:
        """Back after the link was down: our parameters took local steps meanwhile; take the swarm's."""
        self._watchdog.rejoined.clear()
        if self.experiment.mode == "diloco":
            return  # DiLoCo reloads the outer state itself when its next sync finds it behind
        before = self.optimizer.local_epoch
        self.optimizer.load_state_from_peers()
        logger.warning("Rejoined the swarm: loaded its state (local step %d -> %d)", before, self.optimizer.local_epoch)

    def _say_training(self) -> None:
        self._state("training", f"Training {self.experiment.recipe}")

    def _pause(self, reported: bool = False) -> None:
        if self.control.paused.is_set():
            reason = self.control.pause_reason or "Paused"
        else:
            reason = "GPU use is off for now"
        if not (reported and self.control.paused.is_set()):
            self._state("paused", reason)
        began = time.monotonic()
        if self.on_gpu:
            self.torch.cuda.empty_cache()  # give cached GPU memory back while paused
        withdraw = getattr(getattr(self.optimizer, "tracker", None), "withdraw", None)  # sync mode
        if withdraw is not None:
            withdraw(True)  # the others no longer count us among the peers
            self.optimizer.leave_untriggered_rounds()  # and no group waits for our parts
        while self._should_hold():
            if withdraw is not None:
                self.optimizer.serve_grouped_rounds()
            self.control.stop.wait(0.05)
        if withdraw is not None:
            withdraw(False)
        self.paused_seconds += time.monotonic() - began
        self._window = (time.monotonic(), self.samples, self.compute_seconds)
        if not self.control.stop.is_set():
            self._say_training()

    def _report(self) -> None:
        opt = self.optimizer
        now = time.monotonic()
        self._reported_epoch = opt.local_epoch
        t0, s0, _ = self._window
        local_sps = (self.samples - s0) / max(now - t0, 1e-6)
        self._window = (now, self.samples, self.compute_seconds)
        sent, received = hivemind_ext.traffic()
        if self.experiment.mode == "diloco":
            swarm_fields = dict(global_step=opt.local_epoch, swarm_samples_per_second=local_sps,
                                num_peers=max(1, opt.last_group_size), samples_accumulated=opt.samples_since_launch,
                                target_batch_size=opt.cfg.inner_steps * self.batch_size,
                                next_sync_in=opt.next_sync_in())
        else:
            progress = opt.tracker.global_progress
            swarm_fields = dict(global_step=max(progress.epoch, opt.local_epoch), num_peers=progress.num_peers,
                                swarm_samples_per_second=getattr(opt.tracker, "swarm_samples_per_second", 0.0),
                                samples_accumulated=progress.samples_accumulated,
                                target_batch_size=progress.target_batch_size)
        self.channel.send(
            Progress(
                local_epoch=opt.local_epoch,
                samples_per_second=local_sps,
                loss=self.loss_ema,
                bytes_sent=sent,
                bytes_received=received,
                param_digest=self._current_digest(),
                mode=self.experiment.mode,
                **swarm_fields,
                reachability=self._reachability(),
                **self._device(),
            )
        )
        self.channel.send(
            Stats(
                samples=self.samples,
                samples_dropped=self.dropped(),
                compute_seconds=self.compute_seconds,
                rounds=self._carried_rounds + opt.rounds_joined,
                rounds_failed=getattr(opt, "rounds_failed", 0),
                bytes_sent=sent,
                bytes_received=received,
                paused_seconds=self.paused_seconds,
                averaging_seconds=self._carried_averaging + opt.averaging_seconds,
                device="gpu" if self._on_gpu() else "cpu",
            )
        )
        if metrics_due(self._published, opt.local_epoch, now):
            self._published = (opt.local_epoch, now)
            self._publish_metrics(local_sps)

    def _device(self) -> dict:
        """What it trains on, and on the CPU why not on a GPU: the truth the app shows."""
        torch, runtime = self.torch, gpu_runtime.active()
        runtime_name = runtime.name if runtime is not None else None
        param = next(self.model.parameters(), None)
        if param is not None and param.device.type == "cuda":
            return dict(device=torch.cuda.get_device_name(param.device), gpu_runtime=runtime_name)
        if torch.version.cuda is None:
            note = "GPU support not installed"
        elif self.limits.use_gpu is False:
            note = "GPU use is off"
        elif not torch.cuda.is_available():
            note = "the GPU runtime found no usable GPU"
        else:
            note = ""
        return dict(device="CPU", device_note=note, gpu_runtime=runtime_name)

    def _on_gpu(self) -> bool:
        param = next(self.model.parameters(), None)
        return param is not None and param.device.type == "cuda"

    def _current_digest(self) -> list[float]:
        epoch = (self.optimizer.local_epoch, getattr(self.optimizer, "resyncs", 0))  # DiLoCo resyncs mid-round
        if self._digest[0] != epoch:
            self._digest = (epoch, self.param_digest(self.model))
        return self._digest[1]

    def _publish_metrics(self, local_sps: float) -> None:
        opt = self.optimizer
        metrics.publish(
            self.dht,
            self.experiment.run_id,
            self.public_key,
            metrics.PeerMetrics(
                peer_id=self.peer_id,
                step=opt.local_epoch,
                loss=self.loss_ema,
                samples=self.counted(),
                samples_per_second=local_sps,
                compute_seconds=self.compute_seconds,
                time=time.time(),
                display_name=self.start.display_name,
            ),
        )


class StepWatch:
    """Says "paused" at once when the app pauses while the training loop is blocked in
    ``opt.step()`` (an averaging round, or a wait for the last delayed one: seconds on a slow
    link), and "training" again at once when it resumes before the step ends. The round finishes
    (the swarm counts on it); the loop holds right after it if still paused. Use as
    ``with watch: opt.step()``; ``take()`` tells the loop whether the watch last said "paused"."""

    def __init__(self, control: Control, report: Callable[[], None], resumed: Callable[[], None],
                 grace: float = 0.05):
        self.control, self.report, self.resumed, self.grace = control, report, resumed, grace
        self._inside = threading.Event()
        self._lock = threading.Lock()
        self._steps = 0
        self._reported = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="step-watch", daemon=True)
        self._thread.start()

    def __enter__(self) -> StepWatch:
        self._steps += 1
        self._inside.set()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._inside.clear()

    def take(self) -> bool:
        with self._lock:
            reported, self._reported = self._reported, False
        return reported

    def _run(self) -> None:
        while True:
            self._inside.wait()
            if self._closed:
                return
            step = self._steps
            # a step that ends within the grace costs one wake-up; a longer one is watched
            while not self.control.stop.wait(self.grace) and self._inside.is_set() and self._steps == step:
                paused = self.control.paused.is_set()
                with self._lock:
                    if paused != self._reported and self._inside.is_set() and self._steps == step:
                        self._reported = paused
                        (self.report if paused else self.resumed)()
            while self._inside.is_set() and self._steps == step and not self._closed:
                self.control.stop.wait(self.grace)  # stopping: wait for this step to end

    def close(self) -> None:
        self._closed = True
        self._inside.set()
        self._thread.join(5)


def process_age() -> float:
    """Seconds since this process started. On Linux from /proc, to the clock tick: psutil's
    ``create_time`` adds the boot time, which Linux gives in whole seconds, so an age taken from
    it is off by a fraction of a second that is the same for the whole boot (up to 1 s)."""
    try:
        with open("/proc/self/stat", "rb") as stat, open("/proc/uptime", "rb") as uptime:
            fields = stat.read().rsplit(b")", 1)[1].split()  # after the command's name
            return float(uptime.read().split()[0]) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time() - psutil.Process().create_time()


class _Phases:
    """Seconds spent in each phase of joining, for the log: "12.3 s after the process started
    (imports 6.1 s, data 0.2 s, ...)"."""

    def __init__(self):
        self.began = time.monotonic()
        self.age = process_age()  # before this: imports, waiting for start
        self.laps: list[tuple[str, float]] = []

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.laps.append((name, now - self.began - sum(s for _, s in self.laps)))

    def __str__(self) -> str:
        total = self.age + sum(s for _, s in self.laps)
        parts = ", ".join(f"{name} {s:.1f} s" for name, s in [("start", self.age), *self.laps])
        return f"{total:.1f} s after the process started ({parts})"


class Watchdog:
    """Pings the initial peers (the backbone) every ``period`` seconds from a thread. After the link
    was down, the first ping that gets through puts the backbone back in the routing table, and
    through it the swarm; ``rejoined`` tells the training loop to load the swarm's current state
    (it took steps with local gradients while alone). For a peer that joined ``relayed``,
    ``relay_ok`` says whether its ``/p2p-circuit`` addresses are still there."""

    def __init__(self, dht, initial_peers: list[str], period: float = 5.0, relayed: bool = False,
                 relay_grace: float = 20.0):
        self.dht, self.peers, self.period = dht, list(initial_peers), period
        self.ping = reachability.ping_initial_peers
        self.relayed, self.relay_ok, self.relay_grace = relayed, True, relay_grace
        self._relay_lost_since: float | None = None  # relay addresses gone while the backbone answers
        self.lost_since: float | None = None
        self.rejoined = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)
        if self.peers:
            self._thread.start()

    def _run(self) -> None:
        misses = 0
        relays = self._relay_addresses()
        while not self._stop.wait(self.period):
            answered = self.ping(self.dht, self.peers)
            now_relays = self._relay_addresses() if self.relayed else relays  # a p2pd call each time
            if now_relays != relays:
                logger.warning("Relay addresses: %d -> %d", relays, now_relays)
                relays = now_relays
            if self.relayed and now_relays >= 0:  # -1: p2pd did not answer, nothing learned
                self.relay_ok = now_relays > 0
                if self.relay_ok or not answered:
                    self._relay_lost_since = None
                elif self._relay_lost_since is None:
                    self._relay_lost_since = time.monotonic()
            misses = 0 if answered else misses + 1
            if misses == 2 and self.lost_since is None:  # one slow ping on a busy machine is no loss
                self.lost_since = time.monotonic() - self.period
                logger.warning("Lost contact with the swarm's initial peers")
            elif answered and self.lost_since is not None:
                logger.warning("Back in touch with the swarm after %.0f s (relay addresses: %d)",
                               time.monotonic() - self.lost_since, now_relays)
                self.lost_since = None
                self.rejoined.set()

    def relay_gone(self) -> bool:
        """The backbone answers but our relay addresses have been gone for ``relay_grace`` s: p2pd's
        autorelay never asks a static relay again after a disconnection (go-libp2p #1782), so only
        a fresh daemon gets a reservation back."""
        since = self._relay_lost_since
        return since is not None and time.monotonic() - since >= self.relay_grace

    def _relay_addresses(self) -> int:
        try:
            return sum("p2p-circuit" in str(m) for m in self.dht.get_visible_maddrs(latest=True))
        except Exception:  # only for the log
            return -1

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)


def kill_children(timeout: float = 3.0) -> None:
    """Terminate, then kill, every process this one started (hivemind's helpers and p2pd).

    Spares ``torch_shm_manager`` (torch's ``file_system`` sharing strategy, where file descriptors
    are not offered: ``swarm.prepare_process``): it exits by itself once its last client is gone,
    and it is what unlinks our shared-memory tensors then. Killed while we still run, it left those segments in
    /dev/shm, and our own exit aborted (SIGABRT, libshm "Broken pipe" while freeing a tensor)."""
    proctree.stop_children(timeout, spare=_is_shm_manager)


def _is_shm_manager(proc: psutil.Process) -> bool:
    try:
        return proc.name().startswith("torch_shm_manag")  # the kernel's comm is cut to 15 characters
    except psutil.Error:
        return False
