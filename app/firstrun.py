"""The welcome dialog on first run: consent, the experiment, only-when-idle, GPU use, start at login."""

from __future__ import annotations

import msgspec
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QLabel,
    QVBoxLayout,
)

from dedloc_core.catalog import Catalog
from dedloc_core.prefs import Preferences
from dedloc_core.schema import fields

FIELDS = fields(Preferences)

WELCOME = (
    "<h2>Welcome to DeDLOC Volunteer</h2>"
    "<p>This app lends your computer's spare CPU and GPU time to open, collaborative deep-learning "
    "experiments. Your computer downloads training data, computes gradients and exchanges them with "
    "other volunteers over the Internet. It pauses as soon as you use the computer (if you wish), "
    "and you can pause or snooze it from the tray at any time.</p>"
)


class FirstRunDialog(QDialog):
    def __init__(self, prefs: Preferences, catalog: Catalog | None, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Welcome")
        self.consent = QCheckBox(FIELDS["consent"].title)
        self.experiment = QComboBox()
        for exp in catalog.experiments if catalog else []:
            if exp.status == "active":
                self.experiment.addItem(f"{exp.title} ({exp.organizer})", exp.id)
        self.experiment.addItem("Choose later", None)
        self.idle_only = QCheckBox(FIELDS["idle_only"].title)
        self.idle_only.setChecked(prefs.idle_only)
        self.use_gpu = QCheckBox(FIELDS["use_gpu"].title)
        self.use_gpu.setChecked(prefs.use_gpu)
        self.start_at_login = QCheckBox(FIELDS["start_at_login"].title)
        self.start_at_login.setChecked(prefs.start_at_login)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        self.buttons.button(QDialogButtonBox.StandardButton.Ok).setText("Start")
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        form = QFormLayout()
        form.addRow("Experiment:", self.experiment)
        form.addRow(self.idle_only)
        form.addRow(self.use_gpu)
        form.addRow(self.start_at_login)
        intro = QLabel(WELCOME)
        intro.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.addWidget(intro)
        layout.addWidget(self.consent)
        layout.addLayout(form)
        layout.addWidget(self.buttons)
        self.consent.toggled.connect(self._update)
        self._update()

    def _update(self) -> None:
        self.buttons.button(QDialogButtonBox.StandardButton.Ok).setEnabled(self.consent.isChecked())

    def result_prefs(self, prefs: Preferences) -> Preferences:
        return msgspec.structs.replace(
            prefs,
            consent=self.consent.isChecked(),
            experiment_id=self.experiment.currentData(),
            idle_only=self.idle_only.isChecked(),
            use_gpu=self.use_gpu.isChecked(),
            start_at_login=self.start_at_login.isChecked(),
        )


def first_run(controller, window) -> None:
    """Ask for consent and first choices (over ``window``) once the catalog is known; then save them
    and join the chosen experiment. Nothing when consent was given before."""
    if controller.prefs.consent:
        return

    def ask(_result=None) -> None:
        if controller.catalog is None:
            return
        controller.catalog_changed.disconnect(ask)
        dialog = FirstRunDialog(controller.prefs, controller.catalog.catalog, window)

        def accepted() -> None:
            prefs = dialog.result_prefs(controller.prefs)
            controller.save_prefs(prefs)
            if prefs.experiment_id:
                controller.join(prefs.experiment_id)

        dialog.accepted.connect(accepted)
        dialog.open()
        window.first_run_dialog = dialog

    controller.catalog_changed.connect(ask)
    ask()
