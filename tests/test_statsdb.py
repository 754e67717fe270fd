"""The stats store and recorder on real SQLite files: round trip, migration, compaction, kill -9."""

from __future__ import annotations

import csv
import logging
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dedloc_core.protocol import Hello, State, Stats
from dedloc_core.stats.db import DAY, HOUR, SCHEMA_VERSION, StatsError, StatsStore
from dedloc_core.stats.recorder import StatsRecorder

FIXTURE = Path(__file__).with_name("fixtures") / "stats_v1.sqlite3"
T0 = 1_763_902_800  # 2025-11-23 13:00:00 UTC, an hour boundary


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def stats(samples: int, compute: float, rounds: int = 0, sent: int = 0, received: int = 0, device: str = "cpu"):
    return Stats(samples=samples, compute_seconds=compute, rounds=rounds, bytes_sent=sent, bytes_received=received,
                 paused_seconds=0.0, device=device)


def test_recorder_turns_cumulative_events_into_hourly_rows(tmp_path):
    clock = Clock(T0 + 10)
    rec = StatsRecorder(tmp_path / "s.db", "exp-a", flush_interval=1e9, clock=clock)
    rec.on_event(Hello(version="x", pid=1))
    rec.on_event(stats(8, 1.0, 0, 100, 50))
    clock.t += 60
    rec.on_event(stats(40, 5.0, 1, 1000, 700))
    clock.t = T0 + HOUR + 5  # next hour
    rec.on_event(stats(56, 7.5, 2, 1500, 900))
    # the worker restarts: its totals begin at zero again
    rec.on_event(None)
    rec.on_event(Hello(version="x", pid=2))
    rec.on_event(stats(16, 2.0, 0, 10, 10, device="gpu"))
    # a restart without a hello (totals go down) is noticed too
    rec.on_event(stats(8, 1.0, 0, 5, 5, device="gpu"))
    rec.flush()
    store = rec.store
    total = store.totals()
    assert total.samples == 56 + 16 + 8
    assert total.cpu_seconds == pytest.approx(7.5)
    assert total.gpu_seconds == pytest.approx(3.0)
    assert (total.rounds, total.bytes_sent, total.bytes_received) == (2, 1515, 915)
    hours = store.series("hour")
    assert [p.start for p in hours] == [T0, T0 + HOUR]
    assert [p.samples for p in hours] == [40, 16 + 16 + 8]
    rec.close()


def test_pauses_are_timed_by_reason_across_hours(tmp_path):
    clock = Clock(T0 + HOUR - 100)
    rec = StatsRecorder(tmp_path / "s.db", "exp-a", flush_interval=1e9, clock=clock)
    rec.on_event(State(state="paused", reason="On battery"))
    clock.t += 160  # 100 s in the first hour, 60 s in the next
    rec.tick()
    clock.t += 40
    rec.on_event(State(state="paused", reason="User is active"))
    clock.t += 30
    rec.on_event(State(state="training", reason=""))
    clock.t += 500  # training time is not paused time
    rec.flush()
    assert rec.store.totals(since=T0 + HOUR).paused == pytest.approx({"On battery": 100.0, "User is active": 30.0})
    assert rec.store.totals().paused == pytest.approx({"On battery": 200.0, "User is active": 30.0})
    assert rec.store.totals().paused_seconds == pytest.approx(230.0)
    rec.close()


def test_recorder_commits_every_few_seconds_without_events(tmp_path):
    path = tmp_path / "s.db"
    rec = StatsRecorder(path, "exp-a", flush_interval=0.2).start()
    try:
        rec.on_event(State(state="paused", reason="Scheduled"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with StatsStore(path) as reader:  # another connection sees only committed rows
                if reader.totals().paused.get("Scheduled", 0.0) > 0.3:
                    break
            time.sleep(0.1)
        else:
            pytest.fail("the background thread committed nothing")
    finally:
        rec.close()


def test_begin_switches_experiment_and_resets_totals(tmp_path):
    clock = Clock(T0)
    rec = StatsRecorder(tmp_path / "s.db", "exp-a", flush_interval=1e9, clock=clock)
    rec.on_event(stats(100, 10.0))
    rec.begin("exp-b")
    rec.on_event(stats(30, 3.0))
    rec.flush()
    assert rec.store.experiments() == ["exp-a", "exp-b"]
    assert rec.store.totals(experiment="exp-a").samples == 100
    assert rec.store.totals(experiment="exp-b").samples == 30
    rec.close()


def test_migrates_a_real_v1_file(tmp_path):
    path = tmp_path / "old.db"
    shutil.copy(FIXTURE, path)
    with sqlite3.connect(path) as raw:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == 1
    with StatsStore(path, compact=False) as store:
        assert store.version == SCHEMA_VERSION == 2
        total = store.totals()
        assert total.samples == 1200 + 2400 + 64
        assert total.cpu_seconds == pytest.approx(310.5 + 600.0 + 900.25)
        assert total.gpu_seconds == 0.0
        assert total.bytes_sent == 86_000_000
        assert total.paused == pytest.approx({"unknown": 150.5})
        assert store.totals(experiment="albert-mlm").rounds == 1
        assert [p.samples for p in store.series("hour")] == [1200, 2464]
    with StatsStore(path) as again:  # opening a current file changes nothing
        assert again.totals().samples == 3664
    assert sqlite3.connect(FIXTURE).execute("PRAGMA user_version").fetchone()[0] == 1  # fixture untouched


def test_a_newer_or_broken_file_is_refused_and_kept(tmp_path):
    newer = tmp_path / "newer.db"
    with sqlite3.connect(newer) as raw:
        raw.execute("CREATE TABLE future (x)")
        raw.execute("PRAGMA user_version=99")
    before = newer.read_bytes()
    with pytest.raises(StatsError, match="newer version"):
        StatsStore(newer)
    assert newer.read_bytes() == before
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StatsError, match="left as it is"):
        StatsStore(junk)
    assert junk.read_bytes() == b"this is not a database" * 100


def test_compaction_folds_old_hours_into_days_and_keeps_totals(tmp_path):
    now = T0 + 40 * DAY
    clock = Clock(T0 + 5)
    rec = StatsRecorder(StatsStore(tmp_path / "s.db", threadsafe=True), "e", flush_interval=1e9, clock=clock)
    for i in range(30):  # 30 hours of work, 40 days ago
        clock.t = T0 + i * HOUR + 5
        rec.on_event(stats(10 * (i + 1), float(i + 1)))
    rec.on_event(State(state="paused", reason="Night"))
    clock.t += 50
    rec.on_event(State(state="training"))
    clock.t = now - 10  # and some today
    rec.on_event(stats(1000, 100.0))
    rec.flush()
    store = rec.store
    before = store.totals()
    assert store.compact(now=now) == 30
    after = store.totals()
    assert after == before
    rows = store.db.execute("SELECT span, COUNT(*) FROM usage GROUP BY span ORDER BY span").fetchall()
    assert rows == [(HOUR, 1), (DAY, 2)]  # 30 hours from 13:00 UTC span two UTC days
    assert store.db.execute("SELECT span FROM paused").fetchall() == [(DAY,)]
    assert sum(p.samples for p in store.series("day")) == after.samples
    rec.close()


def test_summary_today_week_all_and_csv_export(tmp_path):
    now = time.time()
    clock = Clock(now - 30 * DAY)
    rec = StatsRecorder(tmp_path / "s.db", "e", flush_interval=1e9, clock=clock)
    rec.on_event(stats(500, 50.0, 5, 10, 20))
    clock.t = now
    rec.on_event(State(state="paused", reason="On battery"))
    clock.t = now + 1
    rec.on_event(stats(600, 60.0, 6, 11, 21))
    rec.flush()
    summary = rec.store.summary(now=now + 1)
    assert summary["all"].samples == 600
    assert summary["today"].samples == 100
    assert summary["week"].samples == 100
    assert summary["today"].paused == pytest.approx({"On battery": 1.0})
    out = tmp_path / "stats.csv"
    assert rec.store.export_csv(out) == 2
    rows = list(csv.DictReader(out.open()))
    assert [int(r["samples"]) for r in rows] == [500, 100]
    assert rows[1]["paused_seconds[On battery]"] == "1.0"
    rec.close()


WRITER = """
import sys, time
from dedloc_core.protocol import Stats
from dedloc_core.stats.recorder import StatsRecorder
rec = StatsRecorder(sys.argv[1], "kill-test", flush_interval=1e9)
i = 0
while True:
    i += 1
    rec.on_event(Stats(samples=8 * i, compute_seconds=0.1 * i, rounds=i, bytes_sent=100 * i,
                       bytes_received=100 * i, paused_seconds=0.0))
    if i % 5 == 0:
        rec.flush()
        print(8 * i, flush=True)
    time.sleep(0.002)
"""


def test_kill_9_while_writing_keeps_every_committed_row(tmp_path):
    path = tmp_path / "s.db"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    committed = 0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            committed = int(line)
            if committed >= 8 * 5 * 40:  # 40 commits
                break
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert committed >= 8 * 5 * 40
    assert (tmp_path / "s.db-wal").exists()  # the kill left a WAL behind, as a crash would
    with StatsStore(path) as store:
        assert store.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        total = store.totals()
        assert total.samples >= committed  # every committed transaction is there
        assert total.samples % 40 == 0  # and no half of one
        assert total.rounds * 8 == total.samples


def test_stats_modules_import_no_torch_or_hivemind():
    code = ("import sys, dedloc_core.stats.db, dedloc_core.stats.recorder, dedloc_core.stats.swarmview, "
            "dedloc_core.stats.cli; heavy = [m for m in ('torch', 'hivemind', 'PySide6') if m in sys.modules]; "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_locked_database_delays_the_commit_and_loses_nothing(tmp_path, caplog):
    path = tmp_path / "s.db"
    clock = Clock(T0)
    rec = StatsRecorder(StatsStore(path, threadsafe=True, timeout=0.1), "e", flush_interval=1.0, clock=clock)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
    clock.t += 2
    rec.on_event(stats(80, 8.0))  # tries to commit, cannot, does not raise
    assert "will retry" in caplog.text
    other.execute("ROLLBACK")
    other.close()
    clock.t += 2
    rec.on_event(stats(96, 9.0))
    with StatsStore(path) as reader:
        assert reader.totals().samples == 96
    rec.close()


QUIET_WORKER = """
import sys, time
from dedloc_core.protocol import Stats
from dedloc_core.stats.recorder import StatsRecorder
rec = StatsRecorder(sys.argv[1], "kill-test").start()  # the app's defaults
time.sleep(0.3)
rec.on_event(Stats(samples=8, compute_seconds=1.0, rounds=0, bytes_sent=0, bytes_received=0, paused_seconds=0.0))
rec.flush()  # a commit (as on_event makes when one is due) ...
rec.on_event(Stats(samples=16, compute_seconds=2.0, rounds=0, bytes_sent=0, bytes_received=0, paused_seconds=0.0))
print("fed", flush=True)  # ... then one more event, and silence (the worker is in an averaging round)
time.sleep(60)
"""


def test_kill_9_loses_at_most_the_last_2_seconds_of_events(tmp_path):
    path = tmp_path / "s.db"
    proc = subprocess.Popen([sys.executable, "-c", QUIET_WORKER, str(path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "fed"
        time.sleep(2.0)  # the event is 2 s old: a crash now must not lose it
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    with StatsStore(path) as store:
        assert store.totals().samples == 16


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MB tmpfs (root only) and a function that fills it to the last byte (returns the filler)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")

    def fill() -> Path:
        filler = disk / "filler"
        fd, size = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600), 65536
        while size:
            try:
                os.write(fd, b"\0" * size)
            except OSError:
                size //= 2
        os.close(fd)
        return filler

    try:
        yield disk, fill
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_delays_the_commits_says_so_once_and_corrupts_nothing(small_disk, caplog):
    caplog.set_level(logging.INFO, logger="dedloc_core.stats.recorder")
    disk, fill = small_disk
    clock = Clock(T0)
    rec = StatsRecorder(StatsStore(disk / "s.db", threadsafe=True), "e", flush_interval=1.0, clock=clock)
    rec.on_event(stats(8, 1.0))
    assert rec.flush()
    filler = fill()
    for i in range(2, 12):  # ten seconds of a full disk, a commit tried each second
        clock.t += 1
        rec.on_event(stats(8 * i, float(i)))
    assert not rec.flush()
    assert caplog.text.count("Could not write statistics") == 1 and "disk is full" in caplog.text
    filler.unlink()
    clock.t += 1
    rec.on_event(stats(8 * 12, 12.0))
    assert "written to" in caplog.text and "again" in caplog.text
    rec.close()
    with StatsStore(disk / "s.db") as store:
        assert store.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert store.totals().samples == 96 and store.totals().cpu_seconds == pytest.approx(12.0)


def test_opening_on_a_full_disk_keeps_the_rows_or_says_the_disk_is_full(small_disk):
    disk, fill = small_disk
    for name in ("s.db", "t.db"):
        rec = StatsRecorder(StatsStore(disk / name, threadsafe=True), "e", flush_interval=1e9,
                            clock=Clock(T0 - 40 * DAY))
        rec.on_event(stats(80, 8.0))
        rec.close()  # an hour row 40 days old: opening the store compacts it (a write)
    reader = StatsStore(disk / "s.db", compact=False)  # an app already running: -wal and -shm exist
    fill()
    with StatsStore(disk / "s.db") as store:  # compaction fails; the store opens all the same
        assert store.totals().samples == 80
        assert store.db.execute("SELECT span FROM usage").fetchall() == [(HOUR,)]
    before = (disk / "t.db").read_bytes()
    for name in ("t.db", "new.db"):  # SQLite cannot make the -shm file: "disk I/O error"
        with pytest.raises(StatsError, match="the disk is full") as caught:
            StatsStore(disk / name)
        assert "move it away" not in str(caught.value)
    assert (disk / "t.db").read_bytes() == before
    reader.close()  # (the last connection: its -wal and -shm go, which frees space)
