"""Catalog sources in the app: "Add experiments…" (an organizer's ``dedloc://add`` link, or a URL and
a key fingerprint: checked in the catalog child process, shown, then trusted or not) and the list of
sources with Remove."""

from __future__ import annotations

from html import escape

from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFormLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from dedloc_core.catalog import child as catalog_child
from dedloc_core.catalog import sources
from dedloc_core.catalog.model import catalog_error
from dedloc_core.errors import user_message

from .controller import Controller


def _check(text: str, typed_fingerprint: str) -> tuple[str, str, object, object]:
    """Off the GUI thread: (url, key, catalog or None, error or None) for what the person entered."""
    if text.startswith(f"{sources.SCHEME}:"):
        url, key = sources.parse_link(text)
    else:
        if not typed_fingerprint.strip():
            raise catalog_error("bad_key", "Enter the organizer's key fingerprint with a plain URL.")
        url, key = text, sources.fetch_key(text, typed_fingerprint)
    catalog, error = catalog_child.inspect(url, key)
    return url, key, catalog, error


class AddSourceDialog(QDialog):
    """Asks whether to trust an organizer's catalog, after showing who signs it."""

    def __init__(self, controller: Controller, link: str = "", parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Add experiments")
        self.setMinimumSize(560, 420)
        self.controller = controller
        self.found: tuple[str, str, str] | None = None  # url, key, organizer
        self.link = QLineEdit(link)
        self.link.setPlaceholderText("dedloc://add?url=…&key=…  or  https://…/catalog.json")
        self.fingerprint = QLineEdit()
        self.fingerprint.setPlaceholderText("16 hex digits, from the organizer's page (with a plain URL)")
        self.check_button = QPushButton("Check")
        self.info = QLabel("Paste the link from the organizer's page, then Check.")
        self.info.setWordWrap(True)
        self.buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Cancel)
        self.trust_button = self.buttons.addButton("Trust and add", QDialogButtonBox.ButtonRole.AcceptRole)
        self.trust_button.setEnabled(False)
        form = QFormLayout()
        form.addRow("Link or URL:", self.link)
        form.addRow("Key fingerprint:", self.fingerprint)
        layout = QVBoxLayout(self)
        layout.addLayout(form)
        layout.addWidget(self.check_button)
        layout.addWidget(self.info, 1)
        layout.addWidget(self.buttons)
        self.check_button.clicked.connect(self.check)
        self.link.textChanged.connect(self._edited)
        self.fingerprint.textChanged.connect(self._edited)
        self.buttons.accepted.connect(self.trust)
        self.buttons.rejected.connect(self.reject)
        self._edited()
        if link:
            self.check()

    def _edited(self) -> None:
        self.found = None
        self.trust_button.setEnabled(False)
        self.fingerprint.setEnabled(not self.link.text().strip().startswith(f"{sources.SCHEME}:"))

    def check(self) -> None:
        text, typed = self.link.text().strip(), self.fingerprint.text()
        self.check_button.setEnabled(False)
        self.info.setText("Checking the organizer's catalog…")
        self.controller.bridge.run(lambda: _check(text, typed), self._checked, self._failed)

    def _checked(self, found) -> None:
        url, key, catalog, error = found
        self.check_button.setEnabled(True)
        if error is not None or catalog is None:
            self._failed(error)
            return
        name = sources.organizer_of(catalog)
        titles = "".join(f"<li>{escape(e.title)}</li>" for e in catalog.experiments[:10])
        self.info.setText(
            f"<p><b>Organizer:</b> {escape(name)}<br><b>Key fingerprint:</b> <tt>{sources.fingerprint(key)}</tt>"
            f"<br><b>Catalog:</b> {escape(url)}</p><p>{len(catalog.experiments)} experiment(s):</p><ul>{titles}</ul>"
            "<p>Compare the fingerprint with the one on the organizer's page. Trusting this organizer lets "
            "its catalog list experiments here; nothing runs until you join one.</p>")
        self.found = (url, key, name)
        self.trust_button.setEnabled(True)

    def _failed(self, error) -> None:
        self.check_button.setEnabled(True)
        msg = user_message(error)
        self.info.setText(f"<p><b>{escape(msg.title)}</b>: {escape(msg.message)}</p><p>{escape(msg.hint)}</p>")

    def trust(self) -> None:
        if self.found is None:
            return
        url, key, name = self.found
        self.controller.add_source(url, key, name)
        self.accept()


class SourcesDialog(QDialog):
    """The catalog sources in use; added ones can be removed."""

    def __init__(self, controller: Controller, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Catalog sources")
        self.setMinimumSize(560, 320)
        self.controller = controller
        self.list = QListWidget()
        self.remove_button = QPushButton("Remove")
        self.add_button = QPushButton("Add experiments…")
        close = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        layout = QVBoxLayout(self)
        layout.addWidget(self.list, 1)
        layout.addWidget(self.add_button)
        layout.addWidget(self.remove_button)
        layout.addWidget(close)
        close.rejected.connect(self.reject)
        self.remove_button.clicked.connect(self.remove_selected)
        self.add_button.clicked.connect(lambda: AddSourceDialog(controller, parent=self).open())
        self.list.currentItemChanged.connect(lambda *_: self._selection())
        controller.catalog_changed.connect(lambda _: self.fill())
        self.fill()

    def fill(self) -> None:
        self.list.clear()
        for state in self.controller.catalog.sources if self.controller.catalog else ():
            where = state.url or "shipped with the app"
            text = f"{state.name or 'Built-in'} — {where}\n{state.experiments} experiment(s)"
            text += f", key {state.fingerprint}" if state.fingerprint else ""
            if state.error is not None:
                text += f"\n{user_message(state.error).line()}"
            item = QListWidgetItem(text)
            item.setData(256, None if state.builtin else state.url)
            self.list.addItem(item)
        self._selection()

    def _selection(self) -> None:
        item = self.list.currentItem()
        self.remove_button.setEnabled(item is not None and item.data(256) is not None)

    def remove_selected(self) -> None:
        item = self.list.currentItem()
        if item is not None and item.data(256):
            self.controller.remove_source(item.data(256))
