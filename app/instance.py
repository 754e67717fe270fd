"""One app per user: the first launch listens on a local socket; a second launch connects, asks the
first to show its window, and exits."""

from __future__ import annotations

import getpass
import re
from collections.abc import Callable

from PySide6.QtCore import QObject
from PySide6.QtNetwork import QLocalServer, QLocalSocket


def default_name() -> str:
    return "dedloc-volunteer-" + re.sub(r"[^A-Za-z0-9_.-]", "_", getpass.getuser())


class SingleInstance(QObject):
    def __init__(self, name: str | None = None, parent: QObject | None = None):
        super().__init__(parent)
        self.name = name or default_name()
        self.server: QLocalServer | None = None

    def notify_running(self, timeout_ms: int = 1000, link: str | None = None) -> bool:
        """If another instance runs, ask it to show its window (and open ``link``, a ``dedloc://``
        link) and return True."""
        socket = QLocalSocket()
        socket.connectToServer(self.name)
        if not socket.waitForConnected(timeout_ms):
            return False
        socket.write(f"add {link}\n".encode() if link else b"show\n")
        socket.waitForBytesWritten(timeout_ms)
        socket.disconnectFromServer()
        return True

    def listen(self, on_show: Callable[[], None], on_link: Callable[[str], None] | None = None) -> bool:
        server = QLocalServer(self)
        if not server.listen(self.name):
            QLocalServer.removeServer(self.name)  # a stale socket left by a crash
            if not server.listen(self.name):
                return False

        def accept() -> None:
            while server.hasPendingConnections():
                conn = server.nextPendingConnection()
                conn.readyRead.connect(lambda c=conn: _read(c, on_show, on_link))
                conn.disconnected.connect(conn.deleteLater)

        server.newConnection.connect(accept)
        self.server = server
        return True

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def _read(conn: QLocalSocket, on_show: Callable[[], None], on_link: Callable[[str], None] | None) -> None:
    for line in bytes(conn.readAll().data()).decode("utf-8", "replace").splitlines():
        if line.startswith("add ") and on_link is not None:
            on_link(line[4:].strip()[:4096])
        elif line.strip() == "show" or line.startswith("add "):
            on_show()
