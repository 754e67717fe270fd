"""Render resources/icons/dedloc-volunteer.svg to the PNG sizes of the hicolor icon theme.

Run after editing the SVG: ``QT_QPA_PLATFORM=offscreen .venv/bin/python installers/make_icons.py``.
The PNGs are committed, so builds need no renderer.
"""

from __future__ import annotations

import sys
from pathlib import Path

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QGuiApplication, QImage, QPainter
from PySide6.QtSvg import QSvgRenderer

ICONS = Path(__file__).resolve().parent.parent / "resources" / "icons"
SIZES = (16, 22, 24, 32, 48, 64, 128, 256, 512)


def main() -> int:
    app = QGuiApplication.instance() or QGuiApplication(sys.argv[:1])  # noqa: F841 - QPainter needs one
    renderer = QSvgRenderer(str(ICONS / "dedloc-volunteer.svg"))
    if not renderer.isValid():
        print("The SVG does not parse.", file=sys.stderr)
        return 1
    for size in SIZES:
        image = QImage(size, size, QImage.Format.Format_ARGB32)
        image.fill(Qt.GlobalColor.transparent)
        painter = QPainter(image)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        renderer.render(painter, QRectF(0, 0, size, size))
        painter.end()
        out = ICONS / f"dedloc-volunteer-{size}.png"
        if not image.save(str(out)):
            print(f"Cannot write {out}", file=sys.stderr)
            return 1
        print(out.relative_to(ICONS.parent.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
