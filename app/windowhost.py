"""The tray process's side of the window: the window runs in its own short-lived process
(``dedloc app --window``, see ``app.remote``), so the tray never loads the window's code, Qt Charts
or the pages' widgets, and gives nothing back to fragmentation when it closes.

The window process connects to the single-instance socket (``app.instance``) and says ``window``;
from then on that connection is a ``Channel``: the tray sends the controller's state once, then each
change as it happens; the window sends the user's commands (join, leave, save preferences, add a
catalog source, ...), which the controller here carries out. The tray stays the only supervisor of
the worker. When the window closes, its process exits."""

from __future__ import annotations

import logging
from dataclasses import asdict, astuple

import msgspec
from PySide6.QtCore import QObject, QProcess
from PySide6.QtNetwork import QLocalSocket

from dedloc_core import prefs as prefs_mod
from dedloc_core import protocol
from dedloc_core.catalog import child as catalog_child
from dedloc_core.workerproc import dedloc_command

from .channel import Channel
from .controller import Controller

logger = logging.getLogger(__name__)


class WindowHost(QObject):
    def __init__(self, controller: Controller, parent: QObject | None = None):
        super().__init__(parent)
        self.controller = controller
        self.channels: list[Channel] = []
        self.process: QProcess | None = None
        self._waiting: list[dict] = []  # what to show once the window process is connected
        c = controller
        c.status_changed.connect(lambda _: self._send("status"))
        c.progress.connect(lambda _: self._send("progress"))
        c.joined_changed.connect(lambda _: self._send("joined"))
        c.catalog_changed.connect(lambda r: self._send("catalog", catalog=catalog_child.encode(r)))
        c.hardware_changed.connect(lambda hw: self._send("hardware", hardware=asdict(hw), idle=c.idle_source_text(),
                                                         gpu_support=astuple(c.gpu_support())))
        c.prefs_changed.connect(lambda p: self._send("prefs", prefs=prefs_mod.to_json(p)))
        c.prefs_warning.connect(lambda text: self._send("prefs_warning", text=text))
        c.logged.connect(lambda e: self._send("log", entry=astuple(e)))
        c.stats_changed.connect(lambda: self._send("stats"))
        c.swarm_changed.connect(lambda s: self._send("swarm", swarm=msgspec.to_builtins(s)))
        c.peer_id_changed.connect(lambda peer_id: self._send("peer_id", peer_id=peer_id))
        c.worker_place_changed.connect(lambda place: self._send("worker_place", worker_place=place))
        c.gpu_support_changed.connect(lambda g: self._send("gpu_support", gpu_support=astuple(g)))
        c.gpu_reading_changed.connect(lambda text: self._send("gpu_reading", gpu_reading=text))
        c.quitting.connect(lambda: self._send("quit"))

    def show(self, page: str | None = None, link: str | None = None) -> None:
        """Bring up the window (at ``page``, with ``link`` in its Add experiments dialog); start
        its process first if none runs."""
        if self.channels:
            for channel in self.channels:
                channel.send("show", page=page, link=link)
            return
        self._waiting.append({"page": page, "link": link})
        if self.process is None or self.process.state() == QProcess.ProcessState.NotRunning:
            command = dedloc_command("app", "--window")
            self.process = QProcess(self)
            self.process.setProcessChannelMode(QProcess.ProcessChannelMode.ForwardedChannels)
            self.process.finished.connect(lambda code, _status, p=self.process: self._finished(p, code))
            self.process.start(command[0], command[1:])

    def attach(self, socket: QLocalSocket, pending: bytes = b"") -> None:
        """A window process connected: give it the state, then every change and what to show."""
        channel = Channel(socket, self, pending)
        self.channels.append(channel)
        channel.received.connect(self.command)
        channel.closed.connect(lambda: self._detach(channel))
        channel.send("state", **self.snapshot())
        waiting, self._waiting = self._waiting or [{"page": None, "link": None}], []
        for shown in waiting:
            channel.send("show", **shown)

    def snapshot(self) -> dict:
        c = self.controller
        return {"prefs": prefs_mod.to_json(c.prefs), "prefs_problem": c.prefs_problem,
                "catalog": catalog_child.encode(c.catalog) if c.catalog is not None else None,
                "hardware": asdict(c.hardware) if c.hardware is not None else None, "idle": c.idle_source_text(),
                "worker_place": c.worker_place(), "gpu_support": astuple(c.gpu_support()),
                "gpu_reading": c.gpu_reading(),
                "swarm": msgspec.to_builtins(c.swarm) if c.swarm is not None else None,
                "log": [astuple(e) for e in c.log_entries], **self._live()}

    def _live(self) -> dict:
        """What changes with every worker event; sent with each message that may have changed it."""
        c = self.controller
        return {"status": astuple(c.status), "joined": msgspec.to_builtins(c.joined) if c.joined else None,
                "progress": protocol.encode(c.last_progress) if c.last_progress else None,
                "worker_state": protocol.encode(c.worker_state) if c.worker_state else None,
                "invite_problems": dict(c.invite_problems)}

    def _send(self, kind: str, **fields) -> None:
        if not self.channels:
            return
        if kind in ("status", "progress", "joined"):
            fields.update(self._live())
        for channel in self.channels:
            channel.send(kind, **fields)

    def command(self, message: dict) -> None:
        """What the user did in the window; a malformed command is logged and dropped."""
        c, kind = self.controller, message["t"]
        try:
            if kind == "join":
                c.join(str(message["id"]))
            elif kind == "leave":
                c.leave()
            elif kind == "refresh_catalog":
                c.refresh_catalog()
            elif kind == "refresh_stats":
                c.refresh_stats()
            elif kind == "save_prefs":
                c.save_prefs(prefs_mod.validate(message["prefs"]))
            elif kind == "add_source":
                c.add_source(str(message["url"]), str(message["key"]), str(message["name"]))
            elif kind == "remove_source":
                c.remove_source(str(message["url"]))
            elif kind == "join_with_invite":
                c.join_with_invite(str(message["id"]), str(message["code"]))
            elif kind == "install_gpu_support":
                c.install_gpu_support()
            else:
                logger.warning("Unknown command from the window: %r", kind[:100])
        except (KeyError, TypeError, ValueError) as exc:  # msgspec's ValidationError is a ValueError
            logger.warning("Bad %r command from the window: %s", kind[:100], str(exc)[:300])

    def close(self, timeout_ms: int = 5000) -> None:
        """The app quits: so does the window process."""
        for channel in list(self.channels):
            channel.send("quit")
            channel.socket.flush()
        if self.process is not None:
            self.process.finished.disconnect()
            if not self.process.waitForFinished(timeout_ms):
                self.process.kill()
                self.process.waitForFinished(timeout_ms)
            self.process = None

    def _detach(self, channel: Channel) -> None:
        if channel in self.channels:
            self.channels.remove(channel)
        channel.deleteLater()

    def _finished(self, process: QProcess, code: int) -> None:
        if code:
            logger.warning("The window process exited with code %d", code)
        if process is self.process:
            self.process = None
            self._waiting.clear()  # it never connected: nothing is shown
        process.deleteLater()
