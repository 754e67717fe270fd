"""Statistics: what this computer gave (from the local stats store) and where the swarm stands (from
the backbone's summary), with Export to CSV.

Charts use Qt Charts (PySide6-Addons), imported only when the page is first shown: measured with
500 points, Qt Charts added 6 MB of resident memory to a bare PySide6 window, pyqtgraph 54 MB (it
pulls in NumPy), and the tray must stay under 100 MB. Reads of the store are small SQLite queries
on the GUI thread (milliseconds); the swarm summary is fetched elsewhere and handed in as a dict.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtGui import QBrush, QColor, QFont, QPainter, QShowEvent
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QScrollArea,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from dedloc_core.errors import DedlocError, user_message
from dedloc_core.stats.db import DAY, HOUR, Point, StatsStore, Totals, hour_of, local_midnight
from dedloc_core.stats.swarmview import SwarmSummary, parse_summary

logger = logging.getLogger(__name__)

PERIODS = (("today", "Today"), ("week", "This week"), ("all", "All time"))
RANGES = {"hours": ("Last 48 hours, per hour", 48, HOUR), "days": ("Last 30 days, per day", 30, DAY)}
HIGHLIGHT = QColor("#fff3c4")
# an invite-only swarm's summary without this computer's valid token: no peer ids, so "you" is not marked
PUBLIC_VIEW = "public view: names only (members see more once this computer has an access token)"


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def human_duration(seconds: float) -> str:
    """h:mm:ss: compute and paused time (a few minutes of training must not read "0 min")."""
    s = int(round(max(0.0, seconds)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def human_count(n: float) -> str:
    return f"{n:,.0f}".replace(",", "\u202f")


class StatisticsPage(QWidget):
    """Totals, charts over time, the swarm's learning curve and leaderboard.

    ``store``: the stats store to read (a ``StatsStore``, a path, or ``None`` for the default file).
    ``peer_id``: this volunteer's peer id, highlighted on the leaderboard (``set_peer_id`` later).
    Call ``refresh()`` when new stats were committed and ``set_swarm_summary(dict)`` with the
    backbone's ``/swarm.json``."""

    def __init__(self, store: StatsStore | Path | str | None = None, *, peer_id: str | None = None,
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.error: str | None = None
        try:
            self.store: StatsStore | None = store if isinstance(store, StatsStore) else StatsStore(store)
        except DedlocError as exc:  # a broken file: say so, keep the file, show the rest
            self.store, self.error = None, user_message(exc).line()
        self.peer_id = peer_id
        self.swarm: SwarmSummary | None = None
        self.charts: dict[str, Any] = {}  # built on first show
        self._stale = False  # the charts miss data that came while the page was hidden
        self._build()
        self.refresh()

    # ---- layout ---------------------------------------------------------------------------------

    def _build(self) -> None:
        inner = QWidget()
        column = QVBoxLayout(inner)
        self.notice = QLabel()
        self.notice.setWordWrap(True)
        self.notice.setStyleSheet("color:#a33;")
        self.notice.setVisible(False)
        column.addWidget(self.notice)

        mine = QGroupBox("What this computer gave")
        grid = QGridLayout(mine)
        self.cells: dict[tuple[str, str], QLabel] = {}
        headers = ["", "Samples", "Compute", "Rounds", "Data sent", "Data received", "Paused"]
        for col, text in enumerate(headers):
            label = QLabel(f"<b>{text}</b>")
            label.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
            grid.addWidget(label, 0, col)
        for row, (key, title) in enumerate(PERIODS, start=1):
            grid.addWidget(QLabel(f"<b>{title}</b>"), row, 0)
            for col, name in enumerate(headers[1:], start=1):
                cell = QLabel("—")
                cell.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.cells[(key, name)] = cell
                grid.addWidget(cell, row, col)
        column.addWidget(mine)

        over_time = QGroupBox("Over time")
        box = QVBoxLayout(over_time)
        bar = QHBoxLayout()
        self.range = QComboBox()
        for key, (title, _, _) in RANGES.items():
            self.range.addItem(title, key)
        self.range.currentIndexChanged.connect(self._range_changed)
        self.export_button = QPushButton("Export to CSV…")
        self.export_button.clicked.connect(self._ask_export)
        bar.addWidget(self.range)
        bar.addStretch(1)
        bar.addWidget(self.export_button)
        box.addLayout(bar)
        self.tabs = QTabWidget()
        self.tabs.setMinimumHeight(260)
        box.addWidget(self.tabs)
        column.addWidget(over_time)

        swarm = QGroupBox("The swarm")
        swarm_box = QVBoxLayout(swarm)
        self.swarm_line = QLabel("No news from the swarm yet.")
        swarm_box.addWidget(self.swarm_line)
        row = QHBoxLayout()
        self.curve_holder = QVBoxLayout()
        row.addLayout(self.curve_holder, 3)
        self.board = QTableWidget(0, 4)
        self.board.setHorizontalHeaderLabels(["#", "Volunteer", "Samples", "Compute"])
        self.board.verticalHeader().setVisible(False)
        self.board.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self.board.horizontalHeader().setSectionResizeMode(1, QHeaderView.ResizeMode.Stretch)
        self.board.setMinimumHeight(220)
        row.addWidget(self.board, 2)
        swarm_box.addLayout(row)
        column.addWidget(swarm)

        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(inner)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(scroll)

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        if not self.charts:
            self._build_charts()
            self._stale = True
        if self._stale:  # charts are redrawn only while they can be seen
            if self.store is not None:  # and the totals with them, so both show the same moment
                for key, totals in self.store.summary().items():
                    self._fill_row(key, totals)
            self._update_charts()
            self._update_swarm()

    def _build_charts(self) -> None:
        from PySide6.QtCharts import QChartView  # lazy: only once the page is shown

        for key, title in (("samples", "Samples"), ("compute", "Compute hours"), ("data", "Data")):
            view = QChartView()
            view.setRenderHint(QPainter.RenderHint.Antialiasing)
            self.tabs.addTab(view, title)
            self.charts[key] = view
        curve = QChartView()
        curve.setMinimumHeight(220)
        self.curve_holder.addWidget(curve)
        curve.show()  # a layout shows a new child only from the event loop; show it now
        self.charts["curve"] = curve

    # ---- data -----------------------------------------------------------------------------------

    def refresh(self, now: float | None = None) -> None:
        """Re-read the store: totals, and the charts if they are built."""
        self._show_notice()
        if self.store is None:
            return
        for key, totals in self.store.summary(now=now).items():
            self._fill_row(key, totals)
        if self.charts and self.isVisible():
            self._update_charts(now)
        else:
            self._stale = True

    def _fill_row(self, key: str, t: Totals) -> None:
        compute = human_duration(t.cpu_seconds + t.gpu_seconds)
        if t.gpu_seconds:
            compute += f" ({human_duration(t.gpu_seconds)} GPU)"
        values = {"Samples": human_count(t.samples), "Compute": compute, "Rounds": human_count(t.rounds),
                  "Data sent": human_bytes(t.bytes_sent), "Data received": human_bytes(t.bytes_received),
                  "Paused": human_duration(t.paused_seconds)}
        for name, text in values.items():
            self.cells[(key, name)].setText(text)
        if t.paused:
            reasons = "\n".join(f"{r}: {human_duration(s)}" for r, s in sorted(t.paused.items(), key=lambda kv: -kv[1]))
            self.cells[(key, "Paused")].setToolTip(reasons)

    def buckets(self, now: float | None = None) -> tuple[list[int], list[Point | None]]:
        """The bucket starts of the chosen range and their points (``None`` for an empty bucket)."""
        assert self.store is not None
        now = time.time() if now is None else now
        _, count, span = RANGES[self.range.currentData()]
        if span == HOUR:
            starts = [hour_of(now) - i * HOUR for i in reversed(range(count))]
        else:  # local midnights; noon steps stay right across daylight-saving changes
            starts = [local_midnight(local_midnight(now) + 12 * HOUR - i * DAY) for i in reversed(range(count))]
        points = {p.start: p for p in self.store.series("hour" if span == HOUR else "day", since=starts[0])}
        return starts, [points.get(s) for s in starts]

    def _range_changed(self, _index: int) -> None:
        self._update_charts()

    def _update_charts(self, now: float | None = None) -> None:
        if not self.charts or self.store is None:
            return
        from PySide6.QtCharts import QBarSeries, QBarSet, QStackedBarSeries

        starts, points = self.buckets(now)
        fmt = "%a %Hh" if self.range.currentData() == "hours" else "%b %d"  # unique within the range
        labels = [time.strftime(fmt, time.localtime(s)) for s in starts]
        x_title = "hour (local time)" if self.range.currentData() == "hours" else "day"

        def bars(series, name: str, values: list[float], color: str) -> None:
            bar_set = QBarSet(name)
            bar_set.setColor(QColor(color))
            bar_set.append(values)
            series.append(bar_set)

        samples = QBarSeries()
        bars(samples, "Samples", [p.samples if p else 0 for p in points], "#3b7dd8")
        compute = QStackedBarSeries()
        bars(compute, "CPU hours", [p.cpu_seconds / 3600 if p else 0 for p in points], "#3b7dd8")
        bars(compute, "GPU hours", [p.gpu_seconds / 3600 if p else 0 for p in points], "#e08a2c")
        data = QBarSeries()
        bars(data, "Sent (MB)", [p.bytes_sent / 1e6 if p else 0 for p in points], "#5aa469")
        bars(data, "Received (MB)", [p.bytes_received / 1e6 if p else 0 for p in points], "#9a9a9a")
        for key, series, unit, fmt in (("samples", samples, "samples", "%.0f"), ("compute", compute, "hours", "%.2f"),
                                       ("data", data, "MB", "%.0f")):
            _bar_chart(self.charts[key], series, labels, unit, fmt, x_title)
        self._stale = False

    # ---- the swarm ------------------------------------------------------------------------------

    def set_peer_id(self, peer_id: str | None) -> None:
        self.peer_id = peer_id
        self._update_swarm()

    def set_swarm_summary(self, summary: dict | SwarmSummary) -> None:
        """Show the backbone's swarm summary (``/swarm.json`` as a dict). A malformed one is reported."""
        try:
            self.swarm = summary if isinstance(summary, SwarmSummary) else parse_summary(summary)
        except DedlocError as exc:
            self.swarm_line.setText(user_message(exc).line())
            return
        self._update_swarm()

    def _update_swarm(self) -> None:
        s = self.swarm
        if s is None:
            return
        self.swarm_line.setText(
            f"Global step <b>{s.global_step}</b> · <b>{s.samples_per_second:.1f}</b> samples/s · "
            f"<b>{s.num_peers}</b> active peers · {len(s.leaderboard)} contributors"
            + (f" · {PUBLIC_VIEW}" if s.redacted else ""))
        self.board.setRowCount(len(s.leaderboard))
        bold = QFont()
        bold.setBold(True)
        for row, c in enumerate(s.leaderboard):
            me = self.peer_id is not None and c.peer_id == self.peer_id
            name = c.name
            cells = [str(row + 1), name + (" (you)" if me else ""), human_count(c.samples),
                     human_duration(c.compute_seconds)]
            for col, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setToolTip(c.peer_id)
                if col in (0, 2, 3):
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                if me:
                    item.setBackground(QBrush(HIGHLIGHT))
                    item.setFont(bold)
                self.board.setItem(row, col, item)
        if "curve" in self.charts:
            _curve_chart(self.charts["curve"], s)

    def my_row(self) -> int | None:
        """The leaderboard row of this volunteer, if listed."""
        if self.swarm is None or self.peer_id is None:
            return None
        return next((i for i, c in enumerate(self.swarm.leaderboard) if c.peer_id == self.peer_id), None)

    # ---- export ---------------------------------------------------------------------------------

    def _ask_export(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export statistics", "dedloc-statistics.csv", "CSV (*.csv)")
        if path:
            self.export_csv(path)

    def export_csv(self, path: Path | str) -> int:
        """Write every stats bucket to ``path``; report the outcome on the page. Returns rows written."""
        if self.store is None:
            return 0
        try:
            rows = self.store.export_csv(path)
        except OSError as exc:
            self.error = f"Could not export to {path}: {user_message(exc).line()}"
            self._show_notice()
            return 0
        self.error = None
        self._show_notice()
        logger.info("Exported %d rows of statistics to %s", rows, path)
        return rows

    def _show_notice(self) -> None:
        self.notice.setText(self.error or "")
        self.notice.setVisible(bool(self.error))


def _reset(view):
    """The view's chart, emptied. Charts are reused, never replaced: a replaced chart is not deleted
    by its view (it leaked 9 MB a redraw here), and deleting it ourselves crashed on pending events."""
    chart = view.chart()
    chart.removeAllSeries()  # deletes them
    for axis in chart.axes():
        chart.removeAxis(axis)
        axis.deleteLater()
    return chart


def _bar_chart(view, series, labels: list[str], unit: str, fmt: str, x_title: str) -> None:
    from PySide6.QtCharts import QBarCategoryAxis, QValueAxis

    chart = _reset(view)
    chart.addSeries(series)
    chart.legend().setAlignment(Qt.AlignmentFlag.AlignBottom)
    chart.legend().setVisible(len(series.barSets()) > 1)
    axis_x = QBarCategoryAxis()
    axis_x.append(labels)
    axis_x.setLabelsAngle(-90)
    small = QFont()
    small.setPointSize(7)
    axis_x.setLabelsFont(small)
    axis_x.setTruncateLabels(False)
    axis_x.setTitleText(x_title)
    chart.addAxis(axis_x, Qt.AlignmentFlag.AlignBottom)
    series.attachAxis(axis_x)
    axis_y = QValueAxis()
    axis_y.setTitleText(unit)
    axis_y.setLabelFormat(fmt)
    top = max((sum(s.at(i) for s in series.barSets()) for i in range(len(labels))), default=0)
    axis_y.setRange(0, top * 1.1 if top > 0 else 1)
    chart.addAxis(axis_y, Qt.AlignmentFlag.AlignLeft)
    series.attachAxis(axis_y)


def _curve_chart(view, s: SwarmSummary) -> None:
    from PySide6.QtCharts import QLineSeries, QValueAxis

    chart = _reset(view)
    chart.setTitle("Learning curve (swarm loss)")
    line = QLineSeries()
    line.setName("loss")
    points = [(p.step, p.loss) for p in s.learning_curve if p.loss is not None]
    for step, loss in points:
        line.append(step, loss)
    chart.addSeries(line)
    chart.legend().setVisible(False)
    axis_x, axis_y = QValueAxis(), QValueAxis()
    axis_x.setTitleText("global step")
    axis_x.setLabelFormat("%d")
    axis_y.setTitleText("loss")
    if points:
        steps, losses = [p[0] for p in points], [p[1] for p in points]
        first, last = min(steps), max(max(steps), min(steps) + 1)
        axis_x.setRange(first, last)
        axis_x.setTickType(QValueAxis.TickType.TicksDynamic)  # whole steps only
        axis_x.setTickAnchor(first)
        axis_x.setTickInterval(max(1, round((last - first) / 6)))
        pad = (max(losses) - min(losses)) * 0.1 or 0.5
        axis_y.setRange(min(losses) - pad, max(losses) + pad)
    chart.addAxis(axis_x, Qt.AlignmentFlag.AlignBottom)
    chart.addAxis(axis_y, Qt.AlignmentFlag.AlignLeft)
    line.attachAxis(axis_x)
    line.attachAxis(axis_y)


def render(db: Path | str, out: Path | str, swarm: dict | None = None, peer_id: str | None = None,
           size: tuple[int, int] = (1100, 1000)) -> bool:
    """Render the page for ``db`` (and a swarm summary) to a PNG. Needs a QApplication."""
    page = StatisticsPage(db, peer_id=peer_id)
    if swarm is not None:
        page.set_swarm_summary(swarm)
    page.resize(*size)
    page.show()
    ok = page.grab().save(str(out))
    page.close()
    return ok


def main(argv: list[str] | None = None) -> int:
    """``python -m app.pages.statistics --db FILE [--swarm swarm.json] [--peer-id ID] --out page.png``"""
    import argparse
    import json
    import os

    p = argparse.ArgumentParser(prog="python -m app.pages.statistics", description="Render the Statistics page.")
    p.add_argument("--db", type=Path, required=True)
    p.add_argument("--swarm", type=Path, default=None, help="a swarm summary (the backbone's /swarm.json)")
    p.add_argument("--peer-id", default=None, help="the peer to highlight on the leaderboard")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if not os.environ.get("DISPLAY") and not os.environ.get("WAYLAND_DISPLAY"):
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([])  # noqa: F841 - keeps the application alive
    swarm = json.loads(args.swarm.read_text()) if args.swarm else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    return 0 if render(args.db, args.out, swarm, args.peer_id) else 1


if __name__ == "__main__":
    raise SystemExit(main())
