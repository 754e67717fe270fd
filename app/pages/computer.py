"""This computer: CPU, RAM, disk, NVIDIA GPUs and the idle-detection source in use."""

from __future__ import annotations

from html import escape

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from dedloc_core.policy.hardware import Hardware

from ..controller import Controller


class ComputerPage(QWidget):
    def __init__(self, controller: Controller):
        super().__init__()
        self.controller = controller
        self.label = QLabel("Detecting hardware…")
        self.label.setTextFormat(Qt.TextFormat.RichText)
        self.label.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.label.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.addWidget(self.label)
        controller.hardware_changed.connect(self.show_hardware)
        controller.worker_place_changed.connect(self._show_again)
        if controller.hardware is not None:
            self.show_hardware(controller.hardware)

    def _show_again(self, _place: str) -> None:
        if self.controller.hardware is not None:
            self.show_hardware(self.controller.hardware)

    def show_hardware(self, hw: Hardware) -> None:
        gpus = "".join(f"<li>{escape(g.name)}: {g.memory_mb / 1024:.1f} GB, driver {escape(g.driver)}</li>"
                       for g in hw.gpus) or f"<li>{escape(hw.gpu_note or 'No NVIDIA GPU found')}</li>"
        idle = escape(self.controller.idle_source_text())
        self.label.setText(
            "<h2>This computer</h2><table cellspacing=6>"
            f"<tr><td><b>CPU</b></td><td>{escape(hw.cpu_model)}</td></tr>"
            f"<tr><td><b>Cores</b></td><td>{hw.cores} cores, {hw.threads} threads</td></tr>"
            f"<tr><td><b>Memory</b></td><td>{hw.ram_gb:.1f} GB</td></tr>"
            f"<tr><td><b>Free disk</b></td><td>{hw.disk_free_gb:.1f} GB</td></tr>"
            f"<tr><td><b>Idle detection</b></td><td>{idle}</td></tr>"
            f"<tr><td><b>Worker runs on</b></td><td>{escape(self.controller.worker_place())}</td></tr>"
            f"</table><h3>GPUs</h3><ul>{gpus}</ul>")
