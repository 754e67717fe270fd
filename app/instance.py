"""One app per user: the first launch listens on a local socket; a second launch connects, asks the
first to show its window, and exits. Lines: ``show`` (or ``show PAGE``), ``add LINK``, and ``window``,
which makes the connection the window process's channel (``app.windowhost``)."""

from __future__ import annotations

import getpass
import hashlib
import re
from collections.abc import Callable

from PySide6.QtCore import QObject
from PySide6.QtNetwork import QLocalServer, QLocalSocket

from dedloc_core import environ


def default_name() -> str:
    """One name per user (and per ``DEDLOC_HOME``: a test's or a benchmark's app is an app apart)."""
    name = "dedloc-volunteer-" + re.sub(r"[^A-Za-z0-9_.-]", "_", getpass.getuser())
    home = environ.HOME.optional()
    return name + "-" + hashlib.sha256(home.encode()).hexdigest()[:8] if home else name


class SingleInstance(QObject):
    def __init__(self, name: str | None = None, parent: QObject | None = None):
        super().__init__(parent)
        self.name = name or default_name()
        self.server: QLocalServer | None = None

    def notify_running(self, timeout_ms: int = 1000, link: str | None = None, page: str | None = None) -> bool:
        """If another instance runs, ask it to show its window (at ``page``; or with ``link``, a
        ``dedloc://`` link, in the Add experiments dialog) and return True."""
        socket = QLocalSocket()
        socket.connectToServer(self.name)
        if not socket.waitForConnected(timeout_ms):
            return False
        socket.write(f"add {link}\n".encode() if link else f"show {page or ''}\n".encode())
        socket.waitForBytesWritten(timeout_ms)
        socket.disconnectFromServer()
        return True

    def listen(self, on_show: Callable[..., None], on_link: Callable[[str], None] | None = None,
               on_window: Callable[[QLocalSocket, bytes], None] | None = None) -> bool:
        """Serve other launches: ``on_show(page or None)``, ``on_link(link)``, ``on_window(socket,
        bytes read after the line)`` (a window process; without ``on_window`` it is hung up on)."""
        server = QLocalServer(self)
        server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)  # this user only
        if not server.listen(self.name):
            QLocalServer.removeServer(self.name)  # a stale socket left by a crash
            if not server.listen(self.name):
                return False

        def accept() -> None:
            while server.hasPendingConnections():
                conn = server.nextPendingConnection()
                conn.readyRead.connect(lambda c=conn: _read(c, on_show, on_link, on_window))
                conn.disconnected.connect(conn.deleteLater)

        server.newConnection.connect(accept)
        self.server = server
        return True

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def _read(conn: QLocalSocket, on_show: Callable[..., None], on_link: Callable[[str], None] | None,
          on_window: Callable[[QLocalSocket, bytes], None] | None) -> None:
    data = bytes(conn.readAll().data())
    if data.startswith(b"window\n"):
        conn.readyRead.disconnect()
        if on_window is None:
            conn.disconnectFromServer()
        else:
            on_window(conn, data[len(b"window\n"):])
        return
    for line in data.decode("utf-8", "replace").splitlines():
        if line.startswith("add ") and on_link is not None:
            on_link(line[4:].strip()[:4096])
        elif line.startswith("add "):
            on_show(None)
        elif line.split(" ", 1)[0] == "show":
            on_show(line[5:].strip()[:100] or None)
