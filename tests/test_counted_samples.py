"""A volunteer's samples figure counts what reached the swarm: samples a state load dropped are taken
off (``Session.counted``), and the running total the worker reports never goes down, which the stats
recorder would read as a new worker and count the whole total again (a real SQLite stats file)."""

from __future__ import annotations

from types import SimpleNamespace

from dedloc_core.engine.training import Session
from dedloc_core.protocol import Stats
from dedloc_core.stats.db import StatsStore
from dedloc_core.stats.recorder import StatsRecorder


def report(rec: StatsRecorder, session: Session) -> int:
    samples = session.counted()
    rec.on_event(Stats(samples=samples, compute_seconds=float(session.samples), rounds=0, bytes_sent=0,
                       bytes_received=0, paused_seconds=0.0))
    return samples


def test_dropped_samples_are_not_counted_and_the_total_never_goes_down(tmp_path):
    session = Session(start=None, control=None, channel=None)
    session.optimizer = SimpleNamespace(samples_dropped=0)
    rec = StatsRecorder(tmp_path / "s.db", "demo", flush_interval=1e9, clock=lambda: 1_000_000.0)
    session.samples = 64
    assert report(rec, session) == 64  # reported while still accumulating
    session.samples, session.optimizer.samples_dropped = 96, 96  # a state load dropped all 96
    assert report(rec, session) == 64  # not less than reported
    session.samples = 160
    assert report(rec, session) == 64  # the 32 dropped after the report come off what follows
    session.samples = 200
    assert report(rec, session) == 104
    rec.close()
    assert StatsStore(tmp_path / "s.db").totals().samples == 104 == 200 - 96


def test_a_follow_up_session_carries_the_counted_total():
    session = Session(start=None, control=None, channel=None)
    session.optimizer = SimpleNamespace(samples_dropped=40, rounds_joined=0, averaging_seconds=0.0)
    session.samples = 100
    follow_up = Session(start=None, control=None, channel=None, carried=session.totals())
    follow_up.optimizer = SimpleNamespace(samples_dropped=0)  # a new optimizer: nothing dropped yet
    assert follow_up.counted() == 60
    follow_up.samples += 10
    assert follow_up.counted() == 70
