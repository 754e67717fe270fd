"""JSON lines over a local socket: between the tray process and its window process. Each message is
one JSON object with a ``t`` (its type); a line that is not one is logged and dropped."""

from __future__ import annotations

import json
import logging

from PySide6.QtCore import QObject, Signal
from PySide6.QtNetwork import QLocalSocket

logger = logging.getLogger(__name__)
MAX_LINE = 8 << 20  # a catalog and 2,000 log entries fit many times over


class Channel(QObject):
    received = Signal(object)  # dict
    closed = Signal()

    def __init__(self, socket: QLocalSocket, parent: QObject | None = None, pending: bytes = b""):
        super().__init__(parent)
        self.socket = socket
        self._buffer = pending
        socket.setParent(self)
        socket.readyRead.connect(self._read)
        socket.disconnected.connect(self.closed)
        if pending:
            self._read()

    def send(self, kind: str, **fields) -> None:
        if self.socket.state() == QLocalSocket.LocalSocketState.ConnectedState:
            self.socket.write((json.dumps({"t": kind, **fields}) + "\n").encode())

    def close(self) -> None:
        self.socket.disconnectFromServer()

    def _read(self) -> None:
        self._buffer += bytes(self.socket.readAll().data())
        *lines, self._buffer = self._buffer.split(b"\n")
        if len(self._buffer) > MAX_LINE:
            logger.warning("A message over %d bytes on the window channel: closing it", MAX_LINE)
            self._buffer = b""
            self.close()
            return
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:
                logger.warning("Not JSON on the window channel: %r", line[:200])
                continue
            if isinstance(message, dict) and isinstance(message.get("t"), str):
                self.received.emit(message)
            else:
                logger.warning("Not a message on the window channel: %r", line[:200])
