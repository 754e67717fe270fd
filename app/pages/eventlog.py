"""Event log: the worker's and the app's log and error events, filterable by level (the last
``MAX_LOG``, like the controller)."""

from __future__ import annotations

import time

from PySide6.QtCore import QUrl
from PySide6.QtGui import QColor, QDesktopServices
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QPushButton,
    QTreeWidget,
    QTreeWidgetItem,
    QVBoxLayout,
    QWidget,
)

from dedloc_core import paths

from ..controller import MAX_LOG, Controller, LogEntry

LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40, "CRITICAL": 50}
FILTERS = [("Everything", 0), ("Info and above", 20), ("Warnings and errors", 30), ("Errors only", 40)]


class EventLogPage(QWidget):
    def __init__(self, controller: Controller):
        super().__init__()
        self.controller = controller
        self.filter = QComboBox()
        for label, level in FILTERS:
            self.filter.addItem(label, level)
        self.filter.setCurrentIndex(1)
        self.open_button = QPushButton("Open log folder")
        self.tree = QTreeWidget()
        self.tree.setHeaderLabels(["Time", "Level", "Source", "Message"])
        self.tree.setRootIsDecorated(False)
        self.tree.setColumnWidth(0, 80)
        self.tree.setColumnWidth(1, 70)
        self.tree.setColumnWidth(2, 120)
        top = QHBoxLayout()
        top.addWidget(self.filter)
        top.addStretch(1)
        top.addWidget(self.open_button)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(self.tree, 1)
        self.filter.currentIndexChanged.connect(lambda _: self.rebuild())
        self.open_button.clicked.connect(self.open_folder)
        controller.logged.connect(self.add)
        self.rebuild()

    def level(self) -> int:
        return int(self.filter.currentData())

    def rebuild(self) -> None:
        self.tree.clear()
        for entry in self.controller.log_entries:
            self.add(entry)

    def add(self, entry: LogEntry) -> None:
        if LEVELS.get(entry.level, 20) < self.level():
            return
        item = QTreeWidgetItem([time.strftime("%H:%M:%S", time.localtime(entry.time)), entry.level,
                                entry.source, entry.message])
        item.setToolTip(3, entry.message)
        if LEVELS.get(entry.level, 20) >= 40:
            item.setForeground(1, QColor("#b91c1c"))
        elif LEVELS.get(entry.level, 20) >= 30:
            item.setForeground(1, QColor("#b45309"))
        self.tree.addTopLevelItem(item)
        while self.tree.topLevelItemCount() > MAX_LOG:  # the controller keeps no more either
            self.tree.takeTopLevelItem(0)
        self.tree.scrollToItem(item)

    def visible_messages(self) -> list[str]:
        return [self.tree.topLevelItem(i).text(3) for i in range(self.tree.topLevelItemCount())]

    def open_folder(self) -> None:
        QDesktopServices.openUrl(QUrl.fromLocalFile(str(paths.log_dir())))
