"""``dedloc app``: the tray app. One instance per user; the window opens where no tray exists.
``dedloc app --window``: the window of the running tray app, in a process of its own (``app.remote``)."""

from __future__ import annotations

import argparse
import logging
import logging.handlers
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtWidgets import QApplication, QSystemTrayIcon

from dedloc_core import paths

from .bridge import Bridge
from .controller import Controller
from .instance import SingleInstance
from .supervisor import Supervisor
from .tray import Tray

if TYPE_CHECKING:
    from .window import MainWindow
    from .windowhost import WindowHost

logger = logging.getLogger(__name__)
NO_TRAY = ("No system tray was found, so DeDLOC Volunteer runs in this window. Closing it quits the app "
           "and stops contributing. (On GNOME, install the AppIndicator extension to get a tray icon.)")


class App:
    """The parts of a running app, wired together (tests build one with ``build``). With a tray and
    ``host`` (``dedloc app``), the window runs in a process of its own that exits when it closes, so
    the tray stays light (``app.windowhost``); otherwise ``window`` is built here the first time it
    is needed."""

    def __init__(self, qapp: QApplication, bridge: Bridge, supervisor: Supervisor, controller: Controller):
        self.qapp = qapp
        self.bridge = bridge
        self.supervisor = supervisor
        self.controller = controller
        self.tray: Tray | None = None
        self.host: WindowHost | None = None
        self._window: MainWindow | None = None

    @property
    def window(self) -> MainWindow:
        if self._window is None:
            from .window import MainWindow

            window = MainWindow(self.controller)
            if self.tray is None:
                window.quit_on_close = True
                window.on_quit = self.quit
                window.banner(NO_TRAY, "info")
            self._window = window
        return self._window

    def show_window(self, page: str | None = None) -> None:
        if self.host is not None:
            self.host.show(page)
            return
        self.window.bring_up()
        if page in self.window.pages:
            self.window.show_page(page)

    def open_link(self, link: str) -> None:
        """An organizer's ``dedloc://add`` link: the window, at the Add experiments dialog."""
        if self.host is not None:
            self.host.show("Experiments", link)
            return
        self.show_window()
        self.window.show_page("Experiments").open_add_dialog(link)

    def quit(self) -> None:
        self.controller.quit(self._finish)

    def _finish(self) -> None:
        if self.supervisor.recorder is not None:
            self.supervisor.recorder.close()
        self.bridge.shutdown()
        if self.tray is not None:
            self.tray.hide()
        self.qapp.exit(0)  # quit() would ask the windows, and the main window only hides

    def first_run(self) -> None:
        """Ask for consent and first choices once the catalog is known (in the window)."""
        if self.controller.prefs.consent:
            return
        if self.host is not None:
            self.show_window()  # the window process asks
            return
        from .firstrun import first_run

        first_run(self.controller, self.window)


def build(qapp: QApplication, *, prefs_path: Path | None = None, env: dict[str, str] | None = None,
          tray: bool | None = None, window_process: bool = False) -> App:
    """The app's parts; ``window_process``: with a tray, the window runs in a process of its own."""
    bridge = Bridge(qapp)
    stats_store, recorder = _stats()
    supervisor = Supervisor(bridge, env=env, recorder=recorder)
    controller = Controller(bridge, supervisor, prefs_path=prefs_path, stats_store=stats_store)
    app = App(qapp, bridge, supervisor, controller)
    use_tray = QSystemTrayIcon.isSystemTrayAvailable() if tray is None else tray
    if use_tray:
        app.tray = Tray(controller, lambda: app.show_window(), app.quit)
        if window_process:
            from .windowhost import WindowHost

            app.host = WindowHost(controller, qapp)
    qapp.aboutToQuit.connect(lambda: controller.quit(lambda: None))
    return app


def _stats():
    """The stats store and the recorder that feeds it; (None, None) if the database cannot be opened
    (the Statistics page then says why; contributing goes on)."""
    from dedloc_core.errors import DedlocError, user_message
    from dedloc_core.stats.db import StatsStore
    from dedloc_core.stats.recorder import StatsRecorder

    try:
        store = StatsStore()
        return store, StatsRecorder(StatsStore(store.path, threadsafe=True)).start()
    except DedlocError as exc:
        logger.error("Statistics are off: %s", user_message(exc).line())
        return None, None


def setup_logging() -> None:
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    try:
        handler: logging.Handler = logging.handlers.RotatingFileHandler(
            paths.log_dir() / "app.log", maxBytes=2**20, backupCount=3, encoding="utf-8")
    except OSError:
        handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dedloc app", description="The DeDLOC Volunteer tray app.")
    parser.add_argument("--hidden", action="store_true", help="start in the tray without opening the window")
    parser.add_argument("--window", action="store_true", help="the running app's window (the tray starts it)")
    parser.add_argument("link", nargs="?", help="an organizer's dedloc://add link: open the Add experiments dialog")
    args = parser.parse_args(argv)
    setup_logging()
    if args.window:
        from .remote import main as window_main

        return window_main()
    qapp = QApplication.instance() or QApplication(sys.argv[:1])
    qapp.setApplicationName("DeDLOC Volunteer")
    qapp.setQuitOnLastWindowClosed(False)
    instance = SingleInstance()
    if instance.notify_running(link=args.link):
        print("DeDLOC Volunteer is already running: showing its window.")
        return 0
    app = build(qapp, window_process=True)
    instance.listen(app.show_window, app.open_link, app.host.attach if app.host is not None else None)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: app.bridge.post(app.quit))
    if app.tray is not None:
        app.tray.show()
    if app.tray is None or not args.hidden:
        app.show_window()
    app.first_run()
    app.controller.start()
    if args.link:
        app.open_link(args.link)
    code = qapp.exec()
    if app.host is not None:
        app.host.close()
    instance.close()
    return code
