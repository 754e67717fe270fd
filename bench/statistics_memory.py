"""Resident memory of the Statistics page in the GUI process (the tray must stay under 100 MB).

Runs each stage in a fresh interpreter, offscreen: a bare PySide6 window; plus the page built on a
stats store with 30 days of hourly rows (charts not yet imported); plus the page shown (Qt Charts
imported, every chart drawn). Prints RSS and PSS in MB.

    .venv/bin/python bench/statistics_memory.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

STAGE = r"""
import os, sys, time, psutil
os.environ["QT_QPA_PLATFORM"] = "offscreen"
from PySide6.QtWidgets import QApplication, QLabel, QVBoxLayout, QWidget
app = QApplication([])
window = QWidget(); QVBoxLayout(window).addWidget(QLabel("DeDLOC Volunteer")); window.resize(1100, 1000)
stage, db = sys.argv[1], sys.argv[2]
if stage != "bare":
    from app.pages.statistics import StatisticsPage
    page = StatisticsPage(db)  # not shown yet: a top-level widget nobody shows
    if stage == "shown":
        window.layout().addWidget(page)
window.show()
for _ in range(10):
    app.processEvents()
if stage == "shown":
    assert "PySide6.QtCharts" in sys.modules
    page.range.setCurrentIndex(1); app.processEvents(); page.range.setCurrentIndex(0); app.processEvents()
window.grab()
mem = psutil.Process().memory_full_info()
print(f"{stage:<8} rss {mem.rss / 2**20:6.1f} MB   pss {mem.pss / 2**20:6.1f} MB   "
      f"QtCharts loaded: {'PySide6.QtCharts' in sys.modules}")
"""

FILL = r"""
import sys, time
from dedloc_core.protocol import Stats
from dedloc_core.stats.recorder import StatsRecorder
now = time.time(); t = [now - 30 * 86400]
rec = StatsRecorder(sys.argv[1], "tiny-lm-demo", flush_interval=1e9, clock=lambda: t[0])
for i in range(30 * 24 * 6):
    t[0] += 600
    rec.on_event(Stats(samples=64 * i, compute_seconds=60.0 * i, rounds=i // 10, bytes_sent=10**6 * i,
                       bytes_received=10**6 * i, paused_seconds=0))
rec.close()
"""


def main() -> int:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "stats.sqlite3")
        subprocess.run([sys.executable, "-c", FILL, db], check=True, env=env)
        for stage in ("bare", "built", "shown"):
            out = subprocess.run([sys.executable, "-c", STAGE, stage, db], capture_output=True, text=True, env=env)
            if out.returncode != 0:
                print(out.stderr, file=sys.stderr)
                return 1
            print(out.stdout.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
