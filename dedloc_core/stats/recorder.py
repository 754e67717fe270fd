"""Feeds the stats store from a worker's events (the app's supervisor calls it; no Qt, no torch).

A ``stats`` event carries the cumulative totals of one worker process, so the recorder keeps the
last totals it saw and adds the difference. A new worker (a ``hello``, the end of the event stream,
``begin()``, or totals that went down) starts again from zero. Samples count those that reached the
swarm: ``samples`` less ``samples_dropped`` (a state load drops samples not yet in a step), never less
than before, so a drop of samples already recorded comes off the samples that follow. Time paused is measured here, from
``state`` events, so that it carries its reason; the ``paused_seconds`` of ``stats`` is not used.
The supervisor may also pass a ``State(state="paused", reason=...)`` of its own while no worker
runs (a long pause tears the worker down).

Amounts are kept in memory and committed in one small transaction every ``flush_interval``
seconds (1 s; by ``on_event``, ``tick`` or the background thread of ``start()``, which checks four
times as often), so a crash (``kill -9``) loses at most the last 1.25 s of events, even when no
event comes to trigger the commit (a worker inside an averaging round sends none).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dedloc_core.protocol import Hello, State, Stats

from .db import HOUR, Delta, StatsStore, hour_of

logger = logging.getLogger(__name__)

COMPLAIN_EVERY = 60.0  # seconds between two log lines about the same failing commits
TICKS = 4  # the background thread's checks per flush interval (it waited a whole one: 4 s lost)
_STAT_FIELDS = {"rounds": "rounds", "bytes_sent": "bytes_sent", "bytes_received": "bytes_received"}


class StatsRecorder:
    """Records one worker's contribution, one experiment at a time. Safe to call from any thread."""

    def __init__(self, store: StatsStore | Path | str | None = None, experiment: str = "unknown", *,
                 flush_interval: float = 1.0, clock: Callable[[], float] = time.time):
        self.store = store if isinstance(store, StatsStore) else StatsStore(store, threadsafe=True)
        self.experiment = experiment
        self.flush_interval = flush_interval
        self.clock = clock
        self._lock = threading.RLock()
        self._pending: dict[tuple[str, int], Delta] = {}
        self._last: Stats | None = None
        self._counted = 0  # the last worker's samples recorded: computed less dropped, never less than before
        self._paused: tuple[str, float] | None = None  # (reason, credited up to)
        self._next_flush = clock() + flush_interval
        self._failures = 0  # commits failed in a row (a full disk)
        self._next_complaint = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- events ---------------------------------------------------------------------------------

    def begin(self, experiment: str) -> None:
        """A worker starts (or is about to start) training ``experiment``: totals start from zero."""
        with self._lock:
            self._credit_pause(self.clock())
            self.experiment = experiment
            self._last = None

    def on_event(self, event: object) -> None:
        """Take one decoded worker event (``None`` = the worker's event stream ended)."""
        with self._lock:
            now = self.clock()
            if event is None or isinstance(event, Hello):
                self._credit_pause(now)
                self._paused = None
                self._last = None
            elif isinstance(event, State):
                self._credit_pause(now)
                self._paused = (event.reason or "paused", now) if event.state == "paused" else None
            elif isinstance(event, Stats):
                self._add_stats(event, now)
            self._maybe_flush(now)

    def tick(self) -> None:
        """Count paused time up to now and commit if it is time (call it every second or so)."""
        with self._lock:
            now = self.clock()
            self._credit_pause(now)
            self._maybe_flush(now)

    def _add_stats(self, stats: Stats, now: float) -> None:
        last = self._last
        restarted = last is not None and (stats.samples < last.samples or stats.compute_seconds < last.compute_seconds
                                          or stats.bytes_sent < last.bytes_sent or stats.rounds < last.rounds)
        if last is None or restarted:
            last = Stats(samples=0, compute_seconds=0.0, rounds=0, bytes_sent=0, bytes_received=0,
                         paused_seconds=0.0)
            self._counted = 0
        delta = self._delta(self.experiment, hour_of(now))
        # samples that reached the swarm: those a state load dropped are taken off, from the samples
        # that follow when they were recorded already
        counted = max(self._counted, stats.samples - stats.samples_dropped)
        delta.counters["samples"] += counted - self._counted
        self._counted = counted
        for name, column in _STAT_FIELDS.items():
            delta.counters[column] += max(0, getattr(stats, name) - getattr(last, name))
        device = "gpu_seconds" if stats.device == "gpu" else "cpu_seconds"
        delta.counters[device] += max(0.0, stats.compute_seconds - last.compute_seconds)
        self._last = stats

    def _credit_pause(self, now: float) -> None:
        if self._paused is None:
            return
        reason, since = self._paused
        while since < now:
            end = min(now, hour_of(since) + HOUR)
            paused = self._delta(self.experiment, hour_of(since)).paused
            paused[reason] = paused.get(reason, 0.0) + (end - since)
            since = end
        self._paused = (reason, max(since, now))

    def _delta(self, experiment: str, hour: int) -> Delta:
        return self._pending.setdefault((experiment, hour), Delta())

    # ---- committing -----------------------------------------------------------------------------

    def _maybe_flush(self, now: float) -> None:
        if now >= self._next_flush:
            self.flush()

    def flush(self) -> bool:
        """Commit what was collected (one transaction). On a database error (locked, disk full) log
        it (once a minute while it lasts), keep the amounts and return False: the next flush tries again."""
        with self._lock:
            self._credit_pause(self.clock())
            pending = {k: d for k, d in self._pending.items() if not d.empty()}
            self._next_flush = self.clock() + self.flush_interval
            if not pending:
                return True
            try:
                self.store.add(pending)
            except sqlite3.Error as exc:
                now = self.clock()
                if self._failures == 0 or now >= self._next_complaint:  # once a minute, not every second
                    logger.error("Could not write statistics to %s (will retry): %s", self.store.path, exc)
                    self._next_complaint = now + COMPLAIN_EVERY
                self._failures += 1
                return False
            if self._failures:
                logger.info("Statistics written to %s again, after %d failed attempts", self.store.path,
                            self._failures)
                self._failures = 0
            self._pending.clear()
            return True

    def start(self) -> StatsRecorder:
        """Commit every ``flush_interval`` seconds from a background thread, events or not (it checks
        ``TICKS`` times per interval: waking once per interval, it found the commit due only at the next
        wake-up whenever an event had committed between two)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stats-recorder", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval / TICKS):
            try:
                self.tick()
            except Exception:  # the thread must go on
                logger.exception("Statistics recorder failed")

    def close(self) -> None:
        """Stop the thread, commit the rest and close the store."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            self.flush()
            self.store.close()
