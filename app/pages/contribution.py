"""Contribution: when and how much this computer gives. The form is generated from the fields of
``dedloc_core.prefs.Preferences`` (their ``msgspec.Meta``: title = label, description = help, ge/le =
ranges); Save validates the whole model and shows the first problem instead of saving it."""

from __future__ import annotations

import msgspec
from PySide6.QtWidgets import (
    QCheckBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QScrollArea,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from dedloc_core import prefs as prefs_mod
from dedloc_core.prefs import Preferences
from dedloc_core.schema import fields, problem

from ..controller import Controller

SECTIONS = {
    "When": ["idle_only", "idle_minutes", "schedule", "run_on_battery", "other_cpu_limit", "blocking_programs"],
    "How much": ["cpu_share_idle", "cpu_share_in_use", "use_gpu", "gpu_while_in_use", "gpu_memory_cap_mb",
                 "gpu_temp_limit_c", "upload_cap_kbs", "download_cap_kbs", "daily_quota_mb", "long_pause_minutes"],
    "You": ["display_name", "start_at_login"],
    "Where": ["worker_command"],
}
OFF = "Off"
FIELDS = fields(Preferences)


def _bounds(name: str) -> tuple[float, float]:
    field = FIELDS[name]
    return (0.0 if field.ge is None else float(field.ge)), (1e9 if field.le is None else float(field.le))


class ContributionPage(QWidget):
    def __init__(self, controller: Controller):
        super().__init__()
        self.controller = controller
        self.widgets: dict[str, QWidget] = {}
        self.gpu_reading = QLabel()
        controller.gpu_reading_changed.connect(self.show_gpu_reading)
        self.show_gpu_reading(controller.gpu_reading())
        inner = QWidget()
        column = QVBoxLayout(inner)
        for section, names in SECTIONS.items():
            box = QGroupBox(section)
            form = QFormLayout(box)
            for name in names:
                widget = self._widget(name)
                self.widgets[name] = widget
                field = FIELDS[name]
                if isinstance(widget, QCheckBox):
                    form.addRow(widget)
                else:
                    form.addRow(f"{field.title}:", widget)
                if field.description and not isinstance(widget, (QSpinBox, QDoubleSpinBox)):
                    widget.setToolTip(field.description)
                if name == "gpu_temp_limit_c":  # the reading the limit is held against
                    form.addRow("", self.gpu_reading)
            column.addWidget(box)
        column.addStretch(1)
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setWidget(inner)
        self.message = QLabel()
        self.message.setWordWrap(True)
        self.save_button = QPushButton("Save")
        self.revert_button = QPushButton("Revert")
        buttons = QHBoxLayout()
        buttons.addWidget(self.message, 1)
        buttons.addWidget(self.revert_button)
        buttons.addWidget(self.save_button)
        layout = QVBoxLayout(self)
        layout.addWidget(scroll, 1)
        layout.addLayout(buttons)
        self.save_button.clicked.connect(self.save)
        self.revert_button.clicked.connect(lambda: self.load(controller.prefs))
        controller.prefs_changed.connect(self.load)
        self.load(controller.prefs)

    def show_gpu_reading(self, text: str) -> None:
        self.gpu_reading.setText(text)
        self.gpu_reading.setVisible(bool(text))

    def _widget(self, name: str) -> QWidget:
        field = FIELDS[name]
        kind = field.annotation
        if kind is bool:
            return QCheckBox(field.title)
        if kind in (int, float, int | None, float | None):
            low, high = _bounds(name)
            optional = kind in (int | None, float | None)
            spin = QDoubleSpinBox() if kind in (float, float | None) else QSpinBox()
            spin.setRange(low - (1 if optional else 0), min(high, 2**31 - 1))
            if optional:
                spin.setSpecialValueText(OFF)
            if field.description:
                spin.setSuffix(f" {field.description.split(';')[0]}")
            return spin
        edit = QLineEdit()
        if name == "schedule":
            edit.setPlaceholderText("Any time. Example: Mon-Fri 22:00-07:00; Sat,Sun 00:00-23:59")
        elif name == "blocking_programs":
            edit.setPlaceholderText("Comma-separated, e.g. steam, blender")
        return edit

    def load(self, prefs: Preferences) -> None:
        for name, widget in self.widgets.items():
            value = getattr(prefs, name)
            if isinstance(widget, QCheckBox):
                widget.setChecked(bool(value))
            elif isinstance(widget, (QSpinBox, QDoubleSpinBox)):
                widget.setValue(widget.minimum() if value is None else value)
            elif name == "schedule":
                widget.setText(prefs_mod.format_schedule(value))
            elif name == "blocking_programs":
                widget.setText(", ".join(value))
            else:
                widget.setText(str(value))
        self.message.clear()

    def values(self) -> dict:
        data = prefs_mod.to_json(self.controller.prefs)
        for name, widget in self.widgets.items():
            if isinstance(widget, QCheckBox):
                data[name] = widget.isChecked()
            elif isinstance(widget, (QSpinBox, QDoubleSpinBox)):
                off = widget.specialValueText() == OFF and widget.value() == widget.minimum()
                data[name] = None if off else widget.value()
            elif name == "schedule":
                data[name] = msgspec.to_builtins(prefs_mod.parse_schedule(widget.text()))
            elif name == "blocking_programs":
                data[name] = [p for p in widget.text().split(",")]
            else:
                data[name] = widget.text()
        return data

    def save(self) -> bool:
        try:
            new = prefs_mod.validate(self.values())
        except msgspec.ValidationError as exc:
            path, reason = problem(exc)
            field = FIELDS.get(path.partition(".")[0].partition("[")[0])
            where = field.title if field and field.title else "Preferences"
            self._say(f"Not saved. {where}: {reason}", error=True)
            return False
        except ValueError as exc:  # the schedule text
            self._say(f"Not saved. Schedule: {exc}", error=True)
            return False
        self.controller.save_prefs(new)
        self._say("Saved.")
        return True

    def _say(self, text: str, error: bool = False) -> None:
        self.message.setStyleSheet("color:#b91c1c;" if error else "color:#15803d;")
        self.message.setText(text)
