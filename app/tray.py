"""The tray icon: the state and its reason, and Pause / Resume / Snooze / Open window / Quit."""

from __future__ import annotations

from PySide6.QtGui import QAction
from PySide6.QtWidgets import QMenu, QSystemTrayIcon

from .controller import Controller, Status
from .icons import state_icon


class Tray(QSystemTrayIcon):
    def __init__(self, controller: Controller, show_window, quit_app):
        super().__init__(state_icon("idle"))
        self.controller = controller
        menu = QMenu()
        self.status_action = menu.addAction("")
        self.status_action.setEnabled(False)
        menu.addSeparator()
        self.pause_action = menu.addAction("Pause", controller.pause)
        self.resume_action = menu.addAction("Resume", controller.resume)
        snooze = menu.addMenu("Snooze 1 hour")
        self.snooze_action = snooze.addAction("Everything", lambda: controller.snooze(3600))
        self.snooze_gpu_action = snooze.addAction("GPU only", lambda: controller.snooze(3600, gpu_only=True))
        menu.addSeparator()
        self.open_action: QAction = menu.addAction("Open window", show_window)
        self.quit_action: QAction = menu.addAction("Quit", quit_app)
        self.menu = menu
        self.setContextMenu(menu)
        self.activated.connect(self._activated)
        self._show_window = show_window
        controller.status_changed.connect(self.show_status)
        controller.notify.connect(self.tell)
        self.show_status(controller.status)

    def show_status(self, status: Status) -> None:
        self.setIcon(state_icon(status.state))
        self.setToolTip(f"DeDLOC Volunteer — {status.text}")
        self.status_action.setText(status.text)
        joined = self.controller.joined is not None
        held = self.controller.held_by_user()  # a pause by the policy (you are here) has no Resume
        self.pause_action.setVisible(joined and not held)
        self.resume_action.setVisible(joined and held)
        self.snooze_action.setEnabled(joined)
        self.snooze_gpu_action.setEnabled(joined)

    def tell(self, title: str, message: str) -> None:
        """A notification from the tray icon (the desktop's notification area, where there is one)."""
        self.last_message = (title, message)
        self.showMessage(title, message, QSystemTrayIcon.MessageIcon.Warning, 15000)

    def _activated(self, reason: QSystemTrayIcon.ActivationReason) -> None:
        if reason == QSystemTrayIcon.ActivationReason.Trigger:
            self._show_window()
