"""This computer: CPU, RAM, disk, NVIDIA GPUs and GPU support, the idle-detection source in use, and
where the worker runs."""

from __future__ import annotations

from html import escape

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

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
        self.gpu_label = QLabel()
        self.gpu_label.setWordWrap(True)
        self.install_button = QPushButton("Install GPU support")
        self.install_button.clicked.connect(controller.install_gpu_support)
        gpu_row = QHBoxLayout()
        gpu_row.addWidget(self.gpu_label, 1)
        gpu_row.addWidget(self.install_button)
        layout = QVBoxLayout(self)
        layout.addWidget(self.label)
        layout.addLayout(gpu_row)
        layout.addStretch(1)
        controller.hardware_changed.connect(self.show_hardware)
        controller.worker_place_changed.connect(self._show_again)
        controller.gpu_support_changed.connect(self.show_gpu_support)
        self.show_gpu_support(controller.gpu_support())
        if controller.hardware is not None:
            self.show_hardware(controller.hardware)

    def show_gpu_support(self, support) -> None:
        self.gpu_label.setText(support.text)
        self.gpu_label.setVisible(bool(support.text))
        self.install_button.setVisible(support.can_install)

    def _show_again(self, _place: str) -> None:
        if self.controller.hardware is not None:
            self.show_hardware(self.controller.hardware)

    def show_hardware(self, hw: Hardware) -> None:
        self.show_gpu_support(self.controller.gpu_support())
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
