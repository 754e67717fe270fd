"""Drive the real app on a real X display and save screenshots (run by tests/test_screens.py).

    python tests/screens_app.py OUT_DIR EXPERIMENT_ID

The environment gives DISPLAY (an Xvfb with a window manager and a tray host), DEDLOC_HOME,
DEDLOC_CATALOG_URL, DEDLOC_TRUSTED_KEYS and DEDLOC_INITIAL_PEERS. Joins the experiment, waits for
training progress, saves the first-run dialog, every page of the window and the tray menu as PNGs,
quits, and prints one JSON line with what it saw.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ["QT_QPA_PLATFORM"] = "xcb"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from PySide6.QtCore import QPoint
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QApplication, QSystemTrayIcon

from app.firstrun import FirstRunDialog
from app.main import build


def pump(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        QApplication.processEvents()
        time.sleep(0.02)


def wait_until(check, seconds: float, what: str) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if check():
            return
        pump(0.1)
    raise SystemExit(f"timed out waiting for {what}")


def shoot(out: Path, name: str) -> str:
    pump(0.8)
    path = out / f"{name}.png"
    if not QGuiApplication.primaryScreen().grabWindow(0).save(str(path)):
        raise SystemExit(f"could not save {path}")
    return path.name


_qapps: list[QApplication] = []  # held here: the scripts replace app.qapp to catch the exit


def start_app():
    """The app as ``dedloc app`` builds it (window hidden, tray shown), its controller not started."""
    qapp = QApplication(sys.argv[:1])
    qapp.setQuitOnLastWindowClosed(False)
    _qapps.append(qapp)
    app = build(qapp)
    if app.tray is not None:
        app.tray.show()
    return app


def main() -> int:
    out, experiment = Path(sys.argv[1]), sys.argv[2]
    out.mkdir(parents=True, exist_ok=True)
    app = start_app()
    tray_available = QSystemTrayIcon.isSystemTrayAvailable()
    app.controller.start()
    wait_until(lambda: app.controller.catalog is not None and app.controller.hardware is not None, 60,
               "the catalog and the hardware probe")
    saved = []

    dialog = FirstRunDialog(app.controller.prefs, app.controller.catalog.catalog, None)
    dialog.show()
    saved.append(shoot(out, "first-run"))
    dialog.close()

    if not app.controller.join(experiment):
        raise SystemExit("join refused")
    wait_until(lambda: app.controller.status.state == "training" and app.controller.last_progress, 240,
               "training progress")
    pump(4)  # a few progress events and a statistics refresh
    app.controller.refresh_stats()
    app.show_window()
    for name in app.window.pages:
        app.window.show_page(name)
        saved.append(shoot(out, "page-" + name.lower().replace(" ", "-")))
    app.window.hide()

    status = app.controller.status.text
    if app.tray is not None:
        geometry = app.tray.geometry()
        app.tray.menu.popup(geometry.bottomLeft() if geometry.isValid() else QPoint(900, 30))
        saved.append(shoot(out, "tray-menu"))
        menu_texts = [a.text() for a in app.tray.menu.actions() if a.isVisible() and a.text()]
        app.tray.menu.hide()
    else:
        menu_texts = []

    exits: list[int] = []
    app.qapp = type("Exit", (), {"exit": staticmethod(exits.append)})()
    app.quit()
    wait_until(lambda: exits, 90, "the worker to stop")
    print(json.dumps({"saved": saved, "status": status, "tray": tray_available, "menu": menu_texts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
