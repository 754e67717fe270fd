"""Experiments: the catalog, whether this computer qualifies, Join / Leave / Refresh, and the swarm's
progress for the joined experiment. Catalog errors are shown plainly above the last good catalog."""

from __future__ import annotations

from html import escape

import msgspec
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMessageBox,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from dedloc_core.catalog import Experiment, LoadResult
from dedloc_core.catalog.declared import fit
from dedloc_core.catalog.recipes import DECLARED, validate_params
from dedloc_core.errors import user_message
from dedloc_core.protocol import Progress

from ..controller import Controller


class ExperimentsPage(QWidget):
    def __init__(self, controller: Controller):
        super().__init__()
        self.controller = controller
        self.error = QLabel()
        self.error.setWordWrap(True)
        self.error.setStyleSheet("background:#fde8e8; color:#7f1d1d; padding:6px; border-radius:4px;")
        self.error.hide()
        self.list = QListWidget()
        self.list.setMaximumWidth(280)
        self.details = QLabel("Loading the catalog…")
        self.details.setWordWrap(True)
        self.details.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        self.details.setTextFormat(Qt.TextFormat.RichText)
        self.join_button = QPushButton("Join")
        self.leave_button = QPushButton("Leave")
        self.refresh_button = QPushButton("Refresh")
        self.add_button = QPushButton("Add experiments…")
        self.sources_button = QPushButton("Sources…")
        buttons = QHBoxLayout()
        for b in (self.join_button, self.leave_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        for b in (self.add_button, self.sources_button, self.refresh_button):
            buttons.addWidget(b)
        right = QVBoxLayout()
        right.addWidget(self.details, 1)
        right.addLayout(buttons)
        body = QHBoxLayout()
        body.addWidget(self.list)
        body.addLayout(right, 1)
        layout = QVBoxLayout(self)
        layout.addWidget(self.error)
        layout.addLayout(body, 1)

        self.list.currentItemChanged.connect(lambda *_: self.show_details())
        self.join_button.clicked.connect(self.join_selected)
        self.leave_button.clicked.connect(controller.leave)
        self.refresh_button.clicked.connect(lambda: controller.refresh_catalog())
        self.add_button.clicked.connect(lambda: self.open_add_dialog())
        self.sources_button.clicked.connect(self.open_sources)
        controller.catalog_changed.connect(self.show_catalog)
        controller.hardware_changed.connect(lambda _: self.show_details())
        controller.joined_changed.connect(self._on_joined)
        controller.progress.connect(self._on_progress)
        controller.swarm_changed.connect(lambda _: self._on_progress(None))
        if controller.catalog is not None:
            self.show_catalog(controller.catalog)

    def show_catalog(self, result: LoadResult) -> None:
        problems = []
        if result.error is not None:
            shown = {"last_good": "the last good catalog", "default": "the catalog shipped with the app"}
            still = f" Showing {shown[result.source]}." if result.source in shown else ""
            msg = user_message(result.error)
            hint = f"<br>{escape(msg.hint)}" if msg.hint else ""
            problems.append(f"<b>{escape(msg.title)}</b>: {escape(msg.message)}{escape(still)}{hint}")
        for state in result.sources:
            if state.error is not None and not state.builtin:
                msg = user_message(state.error)
                problems.append(f"<b>{escape(state.name or state.url or '')}: {escape(msg.title)}</b>: "
                                f"{escape(msg.message)}")
        self.error.setText("<br>".join(problems))
        self.error.setVisible(bool(problems))
        current = self.selected_id() or self.controller.prefs.experiment_id
        self.list.clear()
        for exp in result.catalog.experiments if result.catalog else []:
            origin = self.controller.source_label(exp.id)
            where = f" · from {origin}" if origin else ""
            item = QListWidgetItem(f"{exp.title}\n{exp.organizer} · {exp.status}{where}")
            item.setData(Qt.ItemDataRole.UserRole, exp.id)
            self.list.addItem(item)
            if exp.id == current:
                self.list.setCurrentItem(item)
        if self.list.currentItem() is None and self.list.count():
            self.list.setCurrentRow(0)
        self.show_details()

    def _on_joined(self, experiment_id: str | None) -> None:
        """Show the experiment just joined (from the tray, the first-run dialog or this page)."""
        for i in range(self.list.count()):
            if experiment_id and self.list.item(i).data(Qt.ItemDataRole.UserRole) == experiment_id:
                self.list.setCurrentRow(i)
        self.show_details()

    def open_add_dialog(self, link: str = ""):
        from ..sources import AddSourceDialog

        self.add_dialog = AddSourceDialog(self.controller, link, parent=self)
        self.add_dialog.open()
        return self.add_dialog

    def open_sources(self):
        from ..sources import SourcesDialog

        self.sources_dialog = SourcesDialog(self.controller, parent=self)
        self.sources_dialog.open()
        return self.sources_dialog

    def selected_id(self) -> str | None:
        item = self.list.currentItem()
        return item.data(Qt.ItemDataRole.UserRole) if item else None

    def show_details(self) -> None:
        exp = self.controller.experiment(self.selected_id() or "")
        joined = self.controller.joined
        self.leave_button.setEnabled(joined is not None)
        if exp is None:
            self.details.setText("No experiment selected." if self.list.count() else "The catalog is empty.")
            self.join_button.setEnabled(False)
            return
        is_joined = joined is not None and joined.id == exp.id
        self.join_button.setEnabled(exp.status == "active" and not is_joined)
        self.join_button.setText("Switch to this experiment" if joined and not is_joined else "Join")
        self.details.setText(self._describe(exp, is_joined))

    def _describe(self, exp: Experiment, is_joined: bool) -> str:
        hw = self.controller.hardware
        m = exp.needs()
        gpu = f", an NVIDIA GPU with {m.gpu_memory_gb:g} GB" if m.gpu_memory_gb else ", an NVIDIA GPU"
        needs = f"{m.ram_gb:g} GB RAM, {m.cpu_cores} CPU cores, {m.disk_gb:g} GB disk" + (
            gpu if m.gpu_required else "")
        model = model_size(exp)
        if hw is None:
            fit = "Checking this computer…"
        else:
            lacks = hw.unmet(m)
            fit = ("✔ This computer meets the minimums." if not lacks
                   else "✘ This computer lacks " + "; ".join(lacks) + ".")
        rows = [
            f"<h2>{escape(exp.title)}</h2>",
            f"<p><b>Organizer:</b> {escape(exp.organizer)} &nbsp; <b>Status:</b> {escape(exp.status)}"
            f" &nbsp; <b>Recipe:</b> {escape(exp.recipe)} &nbsp; <b>Mode:</b> {escape(mode_name(exp))}</p>",
            f"<p>{escape(exp.description)}</p>",
            f"<p><b>Needs:</b> {escape(needs)}<br>{escape(fit)}</p>",
            *([f"<p><b>Model:</b> {escape(model)}</p>"] if model else []),
        ]
        if exp.needs_token:
            rows.append("<p><b>Invite only.</b> Join asks for the invite code its organizer gave you.</p>")
            problem = self.controller.invite_problems.get(exp.id)
            if problem:
                rows.append(f"<p><b>Your invite no longer works:</b> {escape(problem)} "
                            "Ask the organizer for a new code, then Join again.</p>")
        if is_joined:
            rows.append(f"<p><b>Joined.</b> {escape(self.controller.status.text)}</p>")
            ws = self.controller.worker_state
            if ws is not None and ws.reachability:
                rows.append(f"<p><b>Connection:</b> {escape(CONNECTION.get(ws.reachability, ws.reachability))}</p>")
            p = self.controller.last_progress
            if p is not None:
                loss = f"{p.loss:.3f}" if p.loss is not None else "–"
                if p.mode == "diloco":
                    round_text = f"outer round {p.global_step}, {sync_text(p)}"
                else:
                    round_text = (f"global step {p.global_step}; this round "
                                  f"{p.samples_accumulated}/{p.target_batch_size} samples")
                rows.append(
                    f"<p><b>Swarm:</b> {p.num_peers} peers, {p.swarm_samples_per_second:.0f} samples/s, "
                    f"loss {loss}; {escape(round_text)}</p>")
            rank = self.controller.rank()
            if rank is not None:
                rows.append(f"<p><b>Your rank:</b> {rank[0]} of {rank[1]} volunteers on the leaderboard</p>")
        return "".join(rows)

    def _on_progress(self, _: Progress) -> None:
        joined = self.controller.joined
        if joined is not None and self.selected_id() == joined.id:
            self.show_details()

    def join_selected(self) -> None:
        exp = self.controller.experiment(self.selected_id() or "")
        if exp is None:
            return
        hw = self.controller.hardware
        lacks = hw.unmet(exp.needs()) if hw else []
        if lacks and QMessageBox.question(
                self, "Join anyway?", f"This computer lacks {'; '.join(lacks)}. Join {exp.title} anyway?"
        ) != QMessageBox.StandardButton.Yes:
            return
        code = ""
        if exp.needs_token:
            code, ok = QInputDialog.getText(
                self, "Invite code", f"{exp.title} is invite-only.\nThe invite code {exp.organizer} gave you:",
                QLineEdit.EchoMode.Normal)
            if not ok or not code.strip():
                return
        if not self.controller.prefs.consent:
            self.controller.save_prefs(msgspec.structs.replace(self.controller.prefs, consent=True))
        if code:
            self.controller.join_with_invite(exp.id, code)
        else:
            self.controller.join(exp.id)


CONNECTION = {
    "direct": "direct (other volunteers can reach this computer)",
    "via relay": "via the backbone's relay (this computer is behind a router that blocks incoming connections)",
    "outbound only": "outbound only (no relay could be used; this computer still sends its gradients)",
    "relay lost": ("relay lost (the backbone's relay dropped this computer; it still contributes over the "
                   "connections it opens, but other volunteers cannot reach it)"),
}


def model_size(exp: Experiment) -> str:
    """A declared model's size and what it needs (``declared.fit``); empty for the built-in recipes."""
    if exp.recipe not in DECLARED:
        return ""
    params = validate_params(exp.recipe, exp.recipe_params)
    return f"{params.config.__class__.__name__.removesuffix('Config')}: " + fit(params, exp.batch_size_per_step).text()


def mode_name(exp: Experiment) -> str:
    if exp.mode == "diloco":
        d = exp.diloco
        return f"DiLoCo (syncs every {d.inner_steps} local steps, {d.compression} deltas)"
    return "synchronous (DeDLOC: averages gradients every step)"


def sync_text(p: Progress) -> str:
    """DiLoCo's time to the next outer sync, for people."""
    if p.next_sync_in is None:
        return "next sync: unknown"
    if p.next_sync_in <= 0:
        return "syncing now"
    return f"next sync in {p.next_sync_in:.0f} s"

