"""A volunteer's samples figure counts what reached the swarm: the worker reports the samples it
computed and, of those, the ones a state load dropped (``Session.dropped``); the stats recorder
records the difference into a real SQLite file, never less than before (drops of samples already
recorded come off the samples that follow), and the metrics record does the same (``Session.counted``)."""

from __future__ import annotations

from types import SimpleNamespace

from dedloc_core.engine.training import Session
from dedloc_core.protocol import Stats
from dedloc_core.stats.db import StatsStore
from dedloc_core.stats.recorder import StatsRecorder


def report(rec: StatsRecorder, session: Session) -> None:
    rec.on_event(Stats(samples=session.samples, samples_dropped=session.dropped(),
                       compute_seconds=1.0 * session.samples, rounds=0, bytes_sent=0, bytes_received=0,
                       paused_seconds=0.0))


def recorded(rec: StatsRecorder, path) -> int:
    rec.flush()
    return StatsStore(path).totals().samples


def test_dropped_samples_are_not_recorded_nor_taken_twice(tmp_path):
    path = tmp_path / "s.db"
    session = Session(start=None, control=None, channel=None)
    session.optimizer = SimpleNamespace(samples_dropped=0)
    rec = StatsRecorder(path, "demo", flush_interval=1e9, clock=lambda: 1_000_000.0)
    session.samples = 64
    report(rec, session)  # recorded while still accumulating
    assert recorded(rec, path) == 64 == session.counted()
    session.samples, session.optimizer.samples_dropped = 96, 96  # a state load dropped all 96
    report(rec, session)
    assert recorded(rec, path) == 64 == session.counted()  # nothing taken back, nothing counted twice
    session.samples = 160
    report(rec, session)
    assert recorded(rec, path) == 64 == session.counted()  # the 32 dropped after it come off what follows
    session.samples = 200
    report(rec, session)
    assert recorded(rec, path) == 104 == session.counted() == 200 - 96
    rec.close()


def test_a_follow_up_session_carries_what_was_dropped():
    session = Session(start=None, control=None, channel=None)
    session.optimizer = SimpleNamespace(samples_dropped=0, rounds_joined=0, averaging_seconds=0.0)
    session.samples = 64
    assert session.counted() == 64
    session.samples, session.optimizer.samples_dropped = 100, 80
    assert session.counted() == 64  # 20 computed and kept, 80 dropped
    follow_up = Session(start=None, control=None, channel=None, carried=session.totals())
    follow_up.optimizer = SimpleNamespace(samples_dropped=0)  # a new optimizer: nothing dropped yet
    assert follow_up.dropped() == 80 and follow_up.counted() == 64  # its figure does not go back
    follow_up.samples += 30
    assert follow_up.counted() == 64
    follow_up.samples += 20
    assert follow_up.counted() == 150 - 80
