"""``dedloc stats`` on real stats files."""

from __future__ import annotations

import re
import subprocess
import sys
import time

from dedloc_core.errors import EXIT_EXPLAINED
from dedloc_core.protocol import State, Stats
from dedloc_core.stats.cli import main
from dedloc_core.stats.db import local_midnight
from dedloc_core.stats.recorder import StatsRecorder


def test_prints_today_week_and_all_time(tmp_path, capsys):
    now = local_midnight(time.time()) + 12 * 3600  # noon today: the half hour below stays within today
    clock = [now - 20 * 86400]
    rec = StatsRecorder(tmp_path / "s.db", "tiny-lm-demo", flush_interval=1e9, clock=lambda: clock[0])
    rec.on_event(Stats(samples=12_000, compute_seconds=7200.0, rounds=30, bytes_sent=2_500_000_000,
                       bytes_received=10, paused_seconds=0))
    clock[0] = now
    rec.on_event(State(state="paused", reason="On battery"))
    clock[0] = now + 1800
    rec.on_event(Stats(samples=12_480, compute_seconds=9000.0, rounds=31, bytes_sent=2_600_000_000,
                       bytes_received=20, paused_seconds=0, device="gpu"))
    rec.close()
    out_csv = tmp_path / "out.csv"
    assert main(["--db", str(tmp_path / "s.db"), "--csv", str(out_csv)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines]
    table = {row[0]: row[1:] for row in rows if len(row) == 4}
    assert lines[0].startswith("Statistics from")
    assert table["Samples"] == ["480", "480", "12,480"]
    assert table["CPU compute"] == ["0.00 h", "0.00 h", "2.00 h"]
    assert table["GPU compute"] == ["0.50 h", "0.50 h", "0.50 h"]
    assert table["Data sent"] == ["100.0 MB", "100.0 MB", "2.6 GB"]
    assert "On battery: 0.50 h" in "\n".join(lines)
    assert out_csv.read_text().count("\n") == 3  # header + two hours (20 days ago, today at noon)


def test_bad_files_give_clear_errors(tmp_path, capsys):
    assert main(["--db", str(tmp_path / "missing.db")]) == EXIT_EXPLAINED
    assert "No statistics file" in capsys.readouterr().err
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"garbage" * 100)
    assert main(["--db", str(junk)]) == EXIT_EXPLAINED
    assert "Statistics unavailable" in capsys.readouterr().err
    assert junk.read_bytes() == b"garbage" * 100


def test_dedloc_stats_command_uses_the_user_data_dir(tmp_path):
    out = subprocess.run([sys.executable, "-m", "dedloc_core.cli", "stats"], capture_output=True, text=True,
                         env={"DEDLOC_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert str(tmp_path / "data" / "stats.sqlite3") in out.stdout
    assert "All time" in out.stdout
