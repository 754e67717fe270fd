"""Tray and window icons, one per state, drawn at run time (no files to lose in a frozen build)."""

from __future__ import annotations

from functools import cache

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QBrush, QColor, QIcon, QPainter, QPainterPath, QPen, QPixmap

COLORS = {
    "idle": "#8a8f98",
    "starting": "#3b82f6",
    "training": "#16a34a",
    "paused": "#f59e0b",
    "snoozed": "#8b5cf6",
    "error": "#dc2626",
    "stopping": "#8a8f98",
}


@cache
def state_icon(state: str) -> QIcon:
    icon = QIcon()
    for size in (16, 22, 32, 64):
        icon.addPixmap(_draw(state, size))
    return icon


def _draw(state: str, size: int) -> QPixmap:
    pixmap = QPixmap(size, size)
    pixmap.fill(Qt.GlobalColor.transparent)
    p = QPainter(pixmap)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    color = QColor(COLORS.get(state, COLORS["idle"]))
    m = size * 0.06
    p.setPen(QPen(color.darker(130), max(1.0, size / 16)))
    p.setBrush(QBrush(color))
    p.drawEllipse(QRectF(m, m, size - 2 * m, size - 2 * m))
    p.setPen(Qt.PenStyle.NoPen)
    p.setBrush(QBrush(QColor("white")))
    c, r = size / 2, size * 0.22
    if state in ("paused", "stopping"):
        w = size * 0.11
        p.drawRect(QRectF(c - 2.2 * w, c - r, w * 1.6, 2 * r))
        p.drawRect(QRectF(c + 0.6 * w, c - r, w * 1.6, 2 * r))
    elif state == "training":
        path = QPainterPath(QPointF(c - r * 0.7, c - r))
        path.lineTo(QPointF(c + r, c))
        path.lineTo(QPointF(c - r * 0.7, c + r))
        path.closeSubpath()
        p.drawPath(path)
    elif state == "error":
        p.drawRect(QRectF(c - size * 0.05, c - r, size * 0.1, r * 1.3))
        p.drawEllipse(QPointF(c, c + r * 0.75), size * 0.06, size * 0.06)
    else:  # idle, starting, snoozed: a dot
        p.drawEllipse(QPointF(c, c), r * 0.6, r * 0.6)
    p.end()
    return pixmap
