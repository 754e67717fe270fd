"""The main window: a page list on the left, the page on the right, warnings on top. Closing it
hides it; the app lives on in the tray."""

from __future__ import annotations

from PySide6.QtGui import QCloseEvent
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QListWidget,
    QMainWindow,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from .controller import Controller, Status
from .icons import state_icon
from .pages.computer import ComputerPage
from .pages.contribution import ContributionPage
from .pages.eventlog import EventLogPage
from .pages.experiments import ExperimentsPage
from .pages.statistics import StatisticsPage


class MainWindow(QMainWindow):
    def __init__(self, controller: Controller):
        super().__init__()
        self.controller = controller
        self.setWindowTitle("DeDLOC Volunteer")
        self.resize(960, 620)
        self.quit_on_close = False  # True where no tray exists: closing then quits
        self.on_quit = None
        self.banners = QVBoxLayout()
        self.status = QLabel()
        self.status.setStyleSheet("font-weight:600; padding:4px;")
        self.pages = {
            "Experiments": ExperimentsPage(controller),
            "Contribution": ContributionPage(controller),
            "Statistics": StatisticsPage(controller.stats_store),
            "This computer": ComputerPage(controller),
            "Event log": EventLogPage(controller),
        }
        self.nav = QListWidget()
        self.nav.setMaximumWidth(170)
        self.stack = QStackedWidget()
        for name, page in self.pages.items():
            self.nav.addItem(name)
            self.stack.addWidget(page)
        self.nav.currentRowChanged.connect(self.stack.setCurrentIndex)
        self.nav.setCurrentRow(0)
        body = QHBoxLayout()
        body.addWidget(self.nav)
        body.addWidget(self.stack, 1)
        central = QWidget()
        layout = QVBoxLayout(central)
        layout.addLayout(self.banners)
        layout.addWidget(self.status)
        layout.addLayout(body, 1)
        self.setCentralWidget(central)
        controller.status_changed.connect(self.show_status)
        controller.prefs_warning.connect(lambda text: self.banner(text, "warning"))
        if controller.prefs_problem:
            self.banner(controller.prefs_problem, "warning")
        self.show_status(controller.status)
        stats = self.pages["Statistics"]
        controller.stats_changed.connect(stats.refresh)
        controller.swarm_changed.connect(stats.set_swarm_summary)
        controller.peer_id_changed.connect(stats.set_peer_id)
        if controller.worker_state is not None and controller.worker_state.peer_id:
            stats.set_peer_id(controller.worker_state.peer_id)  # the window may open long after the join

    def show_page(self, name: str) -> QWidget:
        self.nav.setCurrentRow(list(self.pages).index(name))
        return self.pages[name]

    def banner(self, text: str, kind: str = "info") -> QLabel:
        label = QLabel(text)
        label.setWordWrap(True)
        color = {"warning": "#fef3c7; color:#78350f", "info": "#e0f2fe; color:#0c4a6e"}[kind]
        label.setStyleSheet(f"background:{color}; padding:6px; border-radius:4px;")
        self.banners.addWidget(label)
        return label

    def banner_texts(self) -> list[str]:
        return [self.banners.itemAt(i).widget().text() for i in range(self.banners.count())]

    def show_status(self, status: Status) -> None:
        self.status.setText(status.text)
        self.setWindowIcon(state_icon(status.state))

    def bring_up(self) -> None:
        self.show()
        self.setWindowState(self.windowState() & ~self.windowState().WindowMinimized)
        self.raise_()
        self.activateWindow()

    def closeEvent(self, event: QCloseEvent) -> None:  # Qt's name
        event.ignore()
        if self.quit_on_close and self.on_quit is not None:
            self.on_quit()  # stops the worker, then quits
        else:
            self.hide()
