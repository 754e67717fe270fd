"""Drives one worker from the policy: samples, decides, and says what to do with the worker.

The app's controller owns a ``Contributor`` and a timer; every tick (4+ a second) it calls
``tick()`` and carries out the returned actions through its supervisor:

- ``StartWorker(limits)``: start (or restart) the worker with these limits, running.
- ``Pause(reason)`` / ``Resume()``: send the protocol's ``pause`` / ``resume``.
- ``SetLimits(limits)``: send ``set_limits``.
- ``ReleaseWorker(reason)``: stop the worker to free RAM and GPU memory (a long pause); a later
  ``StartWorker`` rejoins the swarm and reloads the state.

The worker starts released: nothing runs until the first decision to run. Transfer totals from
the worker's ``stats`` events go to ``on_stats`` for the daily quota. No Qt, no threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import date, datetime

from dedloc_core.prefs import Preferences
from dedloc_core.protocol import Limits

from .rules import Decision, Inputs, decide
from .sampler import Sampler


@dataclass(frozen=True)
class StartWorker:
    limits: Limits


@dataclass(frozen=True)
class ReleaseWorker:
    reason: str


@dataclass(frozen=True)
class Pause:
    reason: str


@dataclass(frozen=True)
class Resume:
    pass


@dataclass(frozen=True)
class SetLimits:
    limits: Limits


Action = StartWorker | ReleaseWorker | Pause | Resume | SetLimits


class Contributor:
    """``worker`` is ``"released"`` (no worker process), ``"running"`` or ``"paused"``."""

    def __init__(self, prefs: Preferences, sampler: Sampler, *, clock: Callable[[], datetime] = datetime.now,
                 monotonic: Callable[[], float] = time.monotonic):
        self.prefs = prefs
        self.sampler = sampler
        self.clock, self.monotonic = clock, monotonic
        self.worker = "released"
        self.sample = None  # the last Sample the policy decided on
        self.decision: Decision | None = None
        self.user_paused = False
        self.snoozed_until: datetime | None = None
        self.gpu_snoozed_until: datetime | None = None
        self._limits: Limits | None = None  # last limits sent
        self._paused_reason = ""
        self._paused_since = 0.0
        self._quota_day: date | None = None
        self._day_bytes = 0  # sent + received today, over all worker processes
        self._last_total: int | None = None  # the current worker's cumulative total

    # ---- the user's choices ----------------------------------------------------------------

    def pause(self) -> None:
        self.user_paused = True

    def resume(self) -> None:
        self.user_paused = False
        self.snoozed_until = self.gpu_snoozed_until = None

    def snooze(self, seconds: float, gpu_only: bool = False) -> None:
        until = datetime.fromtimestamp(self.clock().timestamp() + seconds)
        if gpu_only:
            self.gpu_snoozed_until = until
        else:
            self.snoozed_until = until

    # ---- from the worker -------------------------------------------------------------------

    def on_stats(self, sent: int, received: int) -> None:
        """Cumulative bytes of the current worker (a ``stats`` event); a new worker starts at 0."""
        self._roll_day()
        total = sent + received
        if self._last_total is None or total < self._last_total:
            self._day_bytes += total
        else:
            self._day_bytes += total - self._last_total
        self._last_total = total

    def worker_released(self) -> None:
        """The worker process is gone (stopped, crashed, or released): the next run starts one."""
        self.worker = "released"
        self._last_total = None
        self._limits = None

    @property
    def bytes_today(self) -> int:
        self._roll_day()
        return self._day_bytes

    def _roll_day(self) -> None:
        today = self.clock().date()
        if today != self._quota_day:
            self._quota_day, self._day_bytes = today, 0

    # ---- the loop ----------------------------------------------------------------------------

    def tick(self) -> list[Action]:
        """Sample, decide, and return what to do with the worker now."""
        s = self.sample = self.sampler.sample()
        now = self.clock()
        quota = self.prefs.daily_quota_mb
        d = decide(Inputs(
            now=now, idle_seconds=s.idle_seconds, on_battery=s.on_battery, other_cpu_percent=s.other_cpu_percent,
            gpu_busy=s.gpu_busy, gpu_temp_c=s.gpu_temp_c,
            gpu_cooling=self.decision is not None and self.decision.gpu_hot, programs=s.programs,
            threads=s.threads, user_paused=self.user_paused,
            snoozed_until=self.snoozed_until, gpu_snoozed_until=self.gpu_snoozed_until,
            quota_used=bool(quota) and self.bytes_today >= quota * 1_000_000,
        ), self.prefs)
        self.decision = d
        return self._apply(d)

    def _apply(self, d: Decision) -> list[Action]:
        actions: list[Action] = []
        if d.run:
            if self.worker == "released":
                actions.append(StartWorker(d.limits))
            else:
                if d.limits != self._limits:
                    actions.append(SetLimits(d.limits))
                if self.worker == "paused":
                    actions.append(Resume())
            self.worker, self._limits = "running", d.limits
        elif self.worker == "running":
            actions.append(Pause(d.reason))
            self.worker, self._paused_reason, self._paused_since = "paused", d.reason, self.monotonic()
        elif self.worker == "paused":
            if self.monotonic() - self._paused_since >= self.prefs.long_pause_minutes * 60:
                actions.append(ReleaseWorker(d.reason))
                self.worker_released()
            elif d.reason != self._paused_reason:
                actions.append(Pause(d.reason))  # same pause, a new reason for the tray
                self._paused_reason = d.reason
        return actions
