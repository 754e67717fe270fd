"""The Statistics page (pytest-qt, offscreen) on a real stats store with rows written by the real
recorder, and a swarm summary from a real SwarmView. Saves artifacts/screens/statistics.png."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import msgspec
import pytest
from PySide6.QtGui import QColor

from app.pages.statistics import HIGHLIGHT, PUBLIC_VIEW, StatisticsPage, human_count
from dedloc_core.protocol import Hello, State, Stats
from dedloc_core.stats.db import HOUR, StatsStore
from dedloc_core.stats.recorder import StatsRecorder
from dedloc_core.stats.swarmview import ANONYMOUS, SwarmView, parse_summary

SCREENS = Path(__file__).resolve().parents[1] / "artifacts" / "screens"
ME = "QmYwAPJzv5CZsnA625s3Xf2nemtYgPpHdWEz79ojWnPbdG"


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def fill(path: Path, now: float) -> int:
    """About 36 hours of contribution through the recorder: two worker sessions, pauses, some GPU."""
    clock = Clock(now - 36 * HOUR)
    rec = StatsRecorder(path, "tiny-lm-demo", flush_interval=1e9, clock=clock)
    samples = compute = sent = 0
    rec.on_event(Hello(version="0.1.0", pid=100))
    for hour in range(36):
        if hour == 20:  # the worker restarts; its totals start from zero
            rec.on_event(None)
            rec.on_event(Hello(version="0.1.0", pid=101))
            samples = compute = sent = 0
        if hour % 9 == 8:
            rec.on_event(State(state="paused", reason="On battery" if hour < 20 else "User is active"))
            clock.t += 1500
            rec.on_event(State(state="training"))
        for _ in range(6):
            clock.t += 600 if hour % 9 != 8 else 350  # one hour per loop
            samples += 8 * (20 + hour % 7 * 10)
            compute += 240.0
            sent += 3_000_000 + hour * 50_000
            rec.on_event(Stats(samples=samples, compute_seconds=compute, rounds=hour + 1, bytes_sent=sent,
                               bytes_received=sent * 9 // 10, paused_seconds=0.0,
                               device="gpu" if hour >= 30 else "cpu"))
    rec.close()
    return StatsStore(path).totals().samples


def swarm_summary(now: float) -> dict:
    view = SwarmView("tiny_lm_demo")
    for step in range(0, 40):
        view.add_point({"time": now - (40 - step) * 60, "step": step, "loss": 6.0 * 0.96**step + 1.2,
                        "samples_per_second": 150.0 + step, "num_peers": 4})
    for pid, name, samples in (("QmAlice0000000000000000000000000000000000000001", "Alice", 91_000),
                               (ME, "me@home", 60_200),
                               ("QmBob00000000000000000000000000000000000000002", "", 41_500),
                               ("QmCarol000000000000000000000000000000000000003", "Carol's lab", 12_000)):
        view.add_record(pid, name, samples, samples / 60, now - 5)
    return msgspec.to_builtins(view.summary(now=now))


@pytest.fixture
def page(qtbot, tmp_path):
    now = time.time()
    total = fill(tmp_path / "stats.sqlite3", now)
    widget = StatisticsPage(tmp_path / "stats.sqlite3", peer_id=ME)
    qtbot.addWidget(widget)
    widget.resize(1100, 1000)
    widget.set_swarm_summary(swarm_summary(now))
    widget.total = total  # type: ignore[attr-defined]
    return widget


def test_page_shows_real_totals_charts_and_leaderboard(page, qtbot, tmp_path):
    assert page.total > 0
    assert page.cells[("all", "Samples")].text() == human_count(page.total)
    assert "GPU" in page.cells[("all", "Compute")].text()
    assert re.fullmatch(r"\d+:\d\d:\d\d \(\d+:\d\d:\d\d GPU\)", page.cells[("all", "Compute")].text())
    assert "On battery" in page.cells[("all", "Paused")].toolTip()
    assert not page.charts  # no chart before the page is shown
    page.show()
    qtbot.waitExposed(page)
    assert set(page.charts) == {"samples", "compute", "data", "curve"}
    for name, view in page.charts.items():  # every chart says what its axes are
        titles = [axis.titleText() for axis in view.chart().axes()]
        assert len(titles) == 2 and all(titles), (name, titles)

    starts, points = page.buckets()
    bars = page.charts["samples"].chart().series()[0].barSets()[0]
    assert [bars.at(i) for i in range(bars.count())] == [p.samples if p else 0 for p in points]
    assert sum(bars.at(i) for i in range(bars.count())) == page.total  # all 36 hours are in the last 48
    curve = page.charts["curve"].chart().series()[0]
    assert curve.count() == 40 and curve.at(39).y() < curve.at(0).y()

    assert page.my_row() == 1
    me = page.board.item(1, 1)
    assert me.text() == "me@home (you)"
    assert me.background().color() == QColor(HIGHLIGHT) and me.font().bold()
    assert not page.board.item(0, 1).font().bold()
    assert page.board.item(2, 1).text() == "…00000002"  # no display name: a short peer id
    assert "Global step <b>39</b>" in page.swarm_line.text()

    page.range.setCurrentIndex(1)  # per day
    starts, points = page.buckets()
    assert len(starts) == 30 and sum(p.samples for p in points if p) == page.total

    SCREENS.mkdir(parents=True, exist_ok=True)
    page.range.setCurrentIndex(0)
    shot = SCREENS / "statistics.png"
    assert page.grab().save(str(shot))
    assert shot.stat().st_size > 20_000

    out = tmp_path / "export.csv"
    assert page.export_csv(out) > 30
    assert out.read_text().startswith("experiment,start_utc,span_seconds,samples")
    assert page.export_csv(tmp_path / "no" / "such" / "dir.csv") == 0
    assert page.notice.isVisibleTo(page) and "Could not export" in page.notice.text()


def test_bad_swarm_summary_and_broken_store_do_not_crash(qtbot, tmp_path):
    junk = tmp_path / "stats.sqlite3"
    junk.write_bytes(b"not a database at all" * 50)
    page = StatisticsPage(junk)
    qtbot.addWidget(page)
    page.show()
    assert "left as it is" in page.notice.text()
    assert junk.read_bytes() == b"not a database at all" * 50
    page.set_swarm_summary({"global_step": "many", "leaderboard": [{"peer_id": 3}]})
    assert "malformed" in page.swarm_line.text()
    page.refresh()
    assert page.export_csv(tmp_path / "x.csv") == 0


def test_chart_library_is_imported_only_when_shown_and_the_page_can_go(tmp_path):
    code = f"""
import sys
from PySide6.QtWidgets import QApplication
app = QApplication([])
from app.pages.statistics import StatisticsPage
page = StatisticsPage({str(tmp_path / "s.sqlite3")!r})
assert "PySide6.QtCharts" not in sys.modules
page.show()
app.processEvents()
assert "PySide6.QtCharts" in sys.modules
assert not any(m in sys.modules for m in ("torch", "hivemind", "numpy")), "heavy import in the GUI"
import gc
del page  # a page that goes away must not crash the app (it did at exit under PySide6 6.12.0)
gc.collect()
app.processEvents()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_qt_calls_keep_none_alive(qtbot):
    """PySide6 6.12.0 on CPython 3.11 dropped a reference to None at every call of a method that
    returns nothing; the process aborts ("deallocating None") once the count reaches zero. We pin
    6.11.3; this guards the pin. (On Python 3.12+ None is immortal and the check passes anyway.)"""
    from PySide6.QtWidgets import QLabel

    label = QLabel()
    qtbot.addWidget(label)
    before = sys.getrefcount(None)
    for _ in range(1000):
        label.setText("x")
    assert sys.getrefcount(None) - before > -100


def test_durations_read_as_h_mm_ss():
    from app.pages.statistics import human_duration

    assert [human_duration(s) for s in (0, 42.4, 600, 3725, 90061)] == [
        "0:00:00", "0:00:42", "0:10:00", "1:02:05", "25:01:01"]


def test_the_public_view_of_an_invite_only_swarm(qtbot, tmp_path):
    """Without this computer's valid token an invite-only backbone sends no peer ids: the page shows
    the names and amounts, says it is the public view, and marks no row as "you"."""
    now = time.time()
    page = StatisticsPage(tmp_path / "stats.sqlite3", peer_id=ME)
    qtbot.addWidget(page)
    summary = swarm_summary(now)
    public = msgspec.to_builtins(parse_summary(summary))
    public["leaderboard"] = [{**c, "peer_id": "", "last_seen": 0.0} for c in public["leaderboard"]]
    public["redacted"] = True
    page.set_swarm_summary(public)
    names = [page.board.item(row, 1).text() for row in range(page.board.rowCount())]
    assert names == ["Alice", "me@home", ANONYMOUS, "Carol's lab"]
    assert page.my_row() is None and not any(page.board.item(row, 1).font().bold() for row in range(4))
    assert PUBLIC_VIEW in page.swarm_line.text() and "Global step <b>39</b>" in page.swarm_line.text()
    page.set_swarm_summary(summary)  # the member's view again (a valid token)
    assert PUBLIC_VIEW not in page.swarm_line.text() and page.my_row() == 1
