"""DiLoCo training: H local steps, then the swarm averages the deltas and an outer optimizer applies them.

The loop, per peer (``DilocoOptimizer.step`` after every micro-batch):

1. The inner optimizer (the recipe's, e.g. AdamW) steps on the local parameters.
2. After ``inner_steps`` (H) steps the peer launches an outer sync in a background thread: its
   delta (outer model minus local parameters, the "pseudo-gradient"; never the weights) goes into
   an all-reduce with the other peers (``delta_averaging.DeltaAverager``), compressed.
3. The next inner steps start at once, so a slow uplink does not stall compute. When the average
   arrives, the outer optimizer (SGD, Nesterov momentum if any) applies it to the outer model, and the
   inner steps made meanwhile are carried over onto the new outer model (a one-step-stale update).
   The loop never waits for a sync: if one outlasts H more steps, the next starts when it ends (so
   pausing and stopping stay immediate).

Joining and leaving: a newcomer downloads the outer model, outer momentum and round number from a
peer, then joins the swarm's next sync at once with a zero update (weight ~0), so it never delays
the round; from its first full round on it sends real deltas. A peer that joins before the swarm
finished its first round (round 0) is a founder: it sends a real delta in round 0 (if the others'
group forms without it, it finds itself behind and reloads, as any late peer). After every round each peer knows the
rounds of its group (all-gathered): a peer that is behind (it missed rounds) reloads the outer state
from the others instead of applying a stale average. A round whose all-reduce fails (a peer killed
while reducing) is retried with the remaining peers from a fresh copy of the deltas. A peer that
finds nobody else alive in the DHT applies its own delta.

Drift: with lossy deltas (8-bit, 4-bit) hivemind's all-reduce gives every peer a slightly different
average (each reduces its own part exactly but gets the others' parts back through the codec:
``delta_averaging`` takes the sender's own loss out, the codec's error on the reply stays), so the
outer models drift apart by the codec's error every round (momentum carries it on). Every
``resync_every`` rounds each peer of the group but its leader (the largest peer id of the group)
downloads the leader's outer state and moves onto it, keeping its inner progress.

Error feedback (lossy codecs): what the codec dropped from this peer's delta in a round
(``DeltaAverager.sent_errors``) is kept as a residual and added to its next real delta, so the
codec's error does not build up over rounds (it is what lets 4-bit deltas hold the loss). A solo
round applies the delta exactly (no residual left); a failed round keeps the residual; loading the
outer state (newcomer, behind) clears it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.utils import get_dht_time

from .delta_averaging import DeltaAverager, RoundResult

logger = logging.getLogger(__name__)

ZERO_WEIGHT = 1e-6  # a zero update still needs a positive weight (hivemind divides by the weights' sum)


@dataclass
class Outcome:
    """How a background sync ended: ``averaged`` (with the group's average), ``solo`` (nobody else
    alive: own delta), ``behind`` (others are at a later round: reload), or ``failed``."""

    kind: str
    averaged: list[torch.Tensor] = field(default_factory=list)
    result: RoundResult | None = None
    lost: list[torch.Tensor] | None = None  # what the codec dropped from our delta (error feedback)


class DilocoOptimizer:
    """Inner optimizer + outer Nesterov SGD + background delta averaging, for one model.

    Has the parts of ``hivemind.Optimizer`` that the worker's loop uses: ``step``, ``zero_grad``,
    ``local_epoch`` (the outer round), ``rounds_joined``, ``averaging_seconds`` and ``shutdown``."""

    def __init__(self, dht, run_id: str, model: torch.nn.Module, recipe, params, *, batch_size: int,
                 matchmaking_time: float, averaging_timeout: float, client_mode: bool = False,
                 load_state_timeout: float = 30.0, follower: bool = False):
        self.dht, self.run_id, self.cfg = dht, run_id, params
        self.follower = follower  # the backbone: follows the outer model, never trains or averages
        self.batch_size = batch_size
        self.matchmaking_time, self.averaging_timeout = matchmaking_time, averaging_timeout
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.inner = recipe.build_optimizer(self.params)
        self.scheduler = recipe.build_scheduler(self.inner)
        self.outer_params = [p.detach().clone() for p in self.params]
        self.outer = torch.optim.SGD(self.outer_params, lr=params.outer_lr, momentum=params.outer_momentum,
                                     nesterov=params.outer_momentum > 0)
        self._lock = threading.Lock()  # guards the outer state (read by newcomers from another thread)
        self.round = 0
        self.rounds_joined = 0
        self.averaging_seconds = 0.0  # time the background syncs spent averaging (the Stats event)
        self.last_group_size = 0
        self.inner_steps = 0  # since the last sync was launched
        self.samples_since_launch = 0
        self.contribute_zero = False
        self.last_contribution: str | None = None
        self._sync: Future[Outcome] | None = None
        self._resync: Future[tuple[int, Any] | None] | None = None  # (round, downloaded leader state)
        self.resyncs = 0
        self.last_drift = 0.0  # relative distance to the leader's outer model at the last resync
        self._base: list[torch.Tensor] = []  # local parameters when the running sync was launched
        self._step_seconds = 0.0  # moving average of one inner step, for next_sync_in
        self._last_step = time.monotonic()
        self._stop = threading.Event()
        self._published = 0.0
        self._rounds_key = f"{run_id}_diloco_rounds"
        self._peer_key = str(dht.peer_id)
        self.averager = DeltaAverager(
            [p.shape for p in self.params], dht, prefix=f"{run_id}_diloco", compression=params.compression,
            state_provider=self._outer_state, min_matchmaking_time=matchmaking_time, client_mode=client_mode,
            request_timeout=1.0, next_chunk_timeout=max(5.0, averaging_timeout / 3),
        )
        # the codec's loss on our last delta, added to the next one (None: no error feedback)
        self._residual = [torch.zeros_like(p) for p in self.outer_params] if self.averager.feedback else None
        self._announce()
        if self._load_outer_state(load_state_timeout):
            logger.info("DiLoCo: loaded the outer model of round %d from the swarm", self.round)

    # ---- the public loop -------------------------------------------------------------------------

    @property
    def local_epoch(self) -> int:
        return self.round

    def zero_grad(self) -> None:
        self.inner.zero_grad(set_to_none=True)

    def step(self) -> None:
        """One inner step; launch, or apply, an outer sync when due."""
        self.inner.step()
        if self.scheduler is not None:
            self.scheduler.step()
        now = time.monotonic()
        elapsed, self._last_step = now - self._last_step, now
        self._step_seconds = elapsed if not self._step_seconds else 0.9 * self._step_seconds + 0.1 * min(elapsed, 60)
        self.inner_steps += 1
        self.samples_since_launch += self.batch_size
        if self._sync is not None and self._sync.done():
            self._finish_sync()
        if self._resync is not None and self._resync.done():
            self._finish_resync()
        if self._sync is None and (self.inner_steps >= self.cfg.inner_steps or self.contribute_zero):
            self._launch_sync()
        if now - self._published > max(5.0, self.averaging_timeout / 2):
            self._announce()

    def next_sync_in(self) -> float:
        """Seconds until this peer launches its next sync (0 while one is running)."""
        if self._sync is not None:
            return 0.0
        return max(0, self.cfg.inner_steps - self.inner_steps) * self._step_seconds

    def outer_digest(self) -> list[float]:
        """A few numbers that identify the outer parameters (identical on every synced peer)."""
        with self._lock, torch.no_grad():
            flat = torch.cat([p.reshape(-1).float() for p in self.outer_params])
        return [float(flat.sum()), float(flat.abs().sum()), float(flat[:: max(1, flat.numel() // 7)].sum())]

    def follow(self, timeout: float = 30.0) -> bool:
        """For a follower: load the outer state when the swarm is at a later round than ours."""
        others = self._other_rounds()
        if others and max(others.values()) > self.round:
            return self._load_outer_state(timeout)
        return False

    def swarm_size(self) -> int:
        """Peers that announced their round lately (this one not counted)."""
        return len(self._other_rounds())

    def state_dict(self) -> dict[str, Any]:
        """The outer model, outer optimizer and round (for checkpoints)."""
        with self._lock:
            return {"round": self.round, "outer_params": [p.clone() for p in self.outer_params],
                    "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._lock, torch.no_grad():
            for param, value in zip(self.outer_params, state["outer_params"], strict=True):
                param.copy_(value)
            self.outer.load_state_dict(state["outer"])
            for param, outer in zip(self.params, self.outer_params, strict=True):
                param.copy_(outer)
            self.round = int(state["round"])
        self.averager.state_sharing_priority = float(self.round)

    def shutdown(self) -> None:
        self._stop.set()
        self.averager.shutdown()  # a sync thread still running is a daemon: it dies with the process

    # ---- syncing ---------------------------------------------------------------------------------

    def _launch_sync(self) -> None:
        local = [p.detach().clone() for p in self.params]
        zero = self.contribute_zero
        with self._lock:
            deltas = [torch.zeros_like(o) if zero else o - x for o, x in zip(self.outer_params, local, strict=True)]
        if self._residual is not None and not zero:
            deltas = [d + r for d, r in zip(deltas, self._residual, strict=True)]
        weight = ZERO_WEIGHT if zero else float(self.samples_since_launch)
        self.last_contribution = "zero" if zero else "real"
        self.contribute_zero = False
        self._base = local
        self.inner_steps = self.samples_since_launch = 0
        self._sync = future = Future()
        threading.Thread(target=self._run_in_background, args=(future, deltas, weight, self.round),
                         name="diloco-sync", daemon=True).start()
        self._announce()

    def _run_in_background(self, future: Future[Outcome], *args: Any) -> None:
        began = time.perf_counter()
        try:
            future.set_result(self._run_sync(*args))
        except Exception:  # the loop trains on; the next sync starts afresh
            logger.exception("DiLoCo sync failed")
            future.set_result(Outcome("failed"))
        finally:
            self.averaging_seconds += time.perf_counter() - began

    def _run_sync(self, deltas: list[torch.Tensor], weight: float, round_: int) -> Outcome:
        """In the background thread: average until a group completes, or decide we are alone/behind."""
        deadline = time.monotonic() + 10 * self.averaging_timeout  # others at our round will come
        attempt_timeout = self.matchmaking_time + self.averaging_timeout
        while not self._stop.is_set():
            result, averaged = self.averager.average(deltas, weight=weight, gather={"round": round_, "weight": weight},
                                                     timeout=attempt_timeout)
            if result.group_size > 1:
                return Outcome("averaged", averaged, result, self.averager.sent_errors())
            logger.info("DiLoCo round %d: no complete group (%s)", round_, result.error)
            others = self._other_rounds()
            if any(r > round_ for r in others.values()):
                return Outcome("behind")
            if not others:
                return Outcome("solo", deltas)
            if time.monotonic() > deadline:
                return Outcome("failed")
            self._stop.wait(0.5)
        return Outcome("failed")

    def _finish_sync(self) -> None:
        assert self._sync is not None
        outcome, self._sync = self._sync.result(), None
        local = [p.detach().clone() for p in self.params]
        progress = [x - b for x, b in zip(local, self._base, strict=True)]  # inner steps made meanwhile
        if outcome.kind == "averaged" and outcome.result and outcome.result.gathered:
            gathered = outcome.result.gathered
            latest = max(int(g.get("round", 0)) for g in gathered.values())
            total = sum(float(g.get("weight", 0)) for g in gathered.values())
            self.last_group_size = len(gathered)
            if latest > self.round:
                outcome = Outcome("behind")
            elif total <= ZERO_WEIGHT * len(gathered):  # only newcomers: nothing to apply
                logger.info("DiLoCo round %d: only zero updates in the group", self.round)
                self._carry(progress)
                return
            else:
                self.rounds_joined += 1
        if outcome.kind in ("averaged", "solo"):
            self._outer_step(outcome.averaged)
            if self._residual is not None:  # solo: our own delta, applied exactly
                self._residual = outcome.lost or [torch.zeros_like(r) for r in self._residual]
            logger.info("DiLoCo round %d done (%s, group of %d, contributed a %s update)", self.round,
                        outcome.kind, max(1, self.last_group_size if outcome.kind == "averaged" else 1),
                        self.last_contribution)
            self._carry(progress)
            if (outcome.kind == "averaged" and self.cfg.resync_every and self.round % self.cfg.resync_every == 0
                    and self.cfg.compression != "none" and self._resync is None):
                leader = max(outcome.result.gathered)
                if leader != self._peer_key:
                    self._launch_resync(leader)
        elif outcome.kind == "behind":
            logger.info("DiLoCo round %d: the swarm is ahead; catching up", self.round)
            if not self._load_outer_state(self.averaging_timeout):
                self._carry(progress)
        else:
            logger.warning("DiLoCo round %d: no group within the timeout; training on", self.round)
            self.contribute_zero = self.last_contribution == "zero"
            self._carry(progress)

    def _launch_resync(self, leader: str) -> None:
        self._resync = future = Future()
        round_ = self.round

        def download() -> None:
            deadline = time.monotonic() + self.averaging_timeout
            try:
                while not self._stop.is_set() and time.monotonic() < deadline:
                    state = self.averager.download_state_from(leader, timeout=self.averaging_timeout)
                    got = int(state[0].get("round", -1)) if state else -1
                    if got >= round_:
                        future.set_result((round_, state))
                        return
                    self._stop.wait(0.2)  # the leader has not applied this round yet
                future.set_result(None)
            except Exception:  # the next resync tries again
                logger.exception("DiLoCo resync failed")
                future.set_result(None)

        threading.Thread(target=download, name="diloco-resync", daemon=True).start()

    def _finish_resync(self) -> None:
        """Move onto the leader's outer model (if it is still at the round we resync), keeping the
        inner progress: local parameters (and the base of a running sync) shift by the same amount."""
        assert self._resync is not None
        found, self._resync = self._resync.result(), None
        if found is None:
            logger.info("DiLoCo round %d: no outer state from the leader; resync skipped", self.round)
            return
        round_, (metadata, tensors) = found
        n = len(self.outer_params)
        if int(metadata.get("round", -1)) != round_ or self.round != round_ or not self._valid_state(metadata, tensors):
            logger.info("DiLoCo round %d: the leader's state is of another round; resync skipped", self.round)
            return
        with self._lock, torch.no_grad():
            shifts = [value.to(o.dtype) - o for value, o in zip(tensors[:n], self.outer_params, strict=True)]
            norm = math.sqrt(sum(float(o.float().pow(2).sum()) for o in self.outer_params)) or 1.0
            self.last_drift = math.sqrt(sum(float(d.float().pow(2).sum()) for d in shifts)) / norm
            for o, p, shift in zip(self.outer_params, self.params, shifts, strict=True):
                o.add_(shift)
                p.add_(shift)
            for base, shift in zip(self._base, shifts, strict=False):
                base.add_(shift)
            for i, o in enumerate(self.outer_params):
                if metadata.get("has_momentum"):
                    self.outer.state[o]["momentum_buffer"] = tensors[n + i].to(o.dtype).clone()
        self.resyncs += 1
        logger.info("DiLoCo round %d: resynced the outer model with the leader (drift %.3g of its norm)",
                    self.round, self.last_drift)

    def _outer_step(self, averaged: list[torch.Tensor]) -> None:
        with self._lock:
            for param, delta in zip(self.outer_params, averaged, strict=True):
                param.grad = delta.to(param.dtype)
            self.outer.step()
            for param in self.outer_params:
                param.grad = None
            self.round += 1
        self.averager.state_sharing_priority = float(self.round)
        self._announce()

    def _carry(self, progress: list[torch.Tensor]) -> None:
        """Local parameters := outer model + the inner progress made since the sync was launched."""
        with self._lock, torch.no_grad():
            for param, outer, step in zip(self.params, self.outer_params, progress, strict=True):
                param.copy_(outer + step)

    # ---- outer state, for newcomers and catching up -------------------------------------------------

    def _outer_state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        with self._lock:
            buffers = [self.outer.state.get(p, {}).get("momentum_buffer") for p in self.outer_params]
            has_momentum = all(b is not None for b in buffers)
            momentum = [b.clone() for b in buffers] if has_momentum else []  # none to send without momentum
            params = [p.clone() for p in self.outer_params]
            return {"round": self.round, "has_momentum": has_momentum}, params + momentum

    def _valid_state(self, metadata: dict[str, Any], tensors: list[torch.Tensor]) -> bool:
        """Outer parameters, then (with momentum) the momentum buffers; older peers always sent both."""
        n = len(self.outer_params)
        counts = (2 * n,) if metadata.get("has_momentum") else (n, 2 * n)
        return len(tensors) in counts and all(
            t.shape == p.shape for t, p in zip(tensors, self.outer_params * 2, strict=False))

    def _load_outer_state(self, timeout: float) -> bool:
        # with nobody training, a follower (the backbone) may still share the outer state it kept
        active = bool(self._other_rounds())
        loaded = self.averager.load_state_from_peers(timeout=timeout)
        if loaded is None:
            if active:
                logger.warning("DiLoCo: could not download the outer state from the swarm")
            return False
        metadata, tensors = loaded
        n = len(self.outer_params)
        if not self._valid_state(metadata, tensors):
            logger.warning("DiLoCo: a peer sent an outer state of the wrong shape; ignored")
            return False
        with self._lock, torch.no_grad():
            for param, value in zip(self.outer_params, tensors[:n], strict=True):
                param.copy_(value)
            for i, param in enumerate(self.outer_params):
                if metadata.get("has_momentum"):
                    self.outer.state[param]["momentum_buffer"] = tensors[n + i].clone()
                else:
                    self.outer.state.pop(param, None)
            for param, outer in zip(self.params, self.outer_params, strict=True):
                param.copy_(outer)
            self.round = int(metadata.get("round", 0))
            if self._residual is not None:
                self._residual = [torch.zeros_like(r) for r in self._residual]
        self.averager.state_sharing_priority = float(self.round)
        # Join the next sync at once with a zero update, so a newcomer never delays a round; except
        # in a swarm that has not finished a round yet (round 0, no momentum): there the newcomer is a
        # founder like the others, and a zero update would throw away its share of the first round.
        self.contribute_zero = self.round > 0 or bool(metadata.get("has_momentum"))
        self.inner_steps = self.samples_since_launch = 0
        self._announce()
        return True

    def _announce(self) -> None:
        """Publish this peer's round in the DHT (how peers tell that they are alone or behind).
        A follower does not: peers would count it as a member of the swarm."""
        self._published = time.monotonic()
        if self.follower:
            return
        ttl = max(30.0, 2 * self.averaging_timeout)
        self.dht.store(self._rounds_key, subkey=self._peer_key, value=self.round,
                       expiration_time=get_dht_time() + ttl, return_future=True)

    def _other_rounds(self) -> dict[str, int]:
        found = self.dht.get(self._rounds_key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        return {str(k): int(v.value) for k, v in found.value.items()
                if str(k) != self._peer_key and isinstance(getattr(v, "value", None), int)}
