"""``dedloc app --window``: the window in its own process, started by the tray app (``WindowHost``)
and gone when the window closes.

``RemoteController`` stands in for the tray's ``Controller``: the same signals and state, mirrored
from the messages the tray sends over the window channel; what the user does (join, leave, save
preferences, add a source, ...) is sent to the tray, which carries it out and sends the new state
back. The Statistics page reads the stats database itself; the Add experiments dialog checks a
catalog in a catalog child process of its own."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import msgspec
from PySide6.QtCore import QTimer
from PySide6.QtNetwork import QLocalSocket
from PySide6.QtWidgets import QApplication

from dedloc_core import prefs as prefs_mod
from dedloc_core import protocol
from dedloc_core.catalog import Experiment
from dedloc_core.catalog import child as catalog_child
from dedloc_core.policy.hardware import Gpu, Hardware
from dedloc_core.prefs import Preferences

from .bridge import Bridge
from .channel import Channel
from .controller import MAX_LOG, ControllerView, GpuSupport, LogEntry, Status
from .instance import default_name

logger = logging.getLogger(__name__)


class RemoteController(ControllerView):
    def __init__(self, channel: Channel, bridge: Bridge, state: dict):
        super().__init__()
        self.channel, self.bridge = channel, bridge
        self.stats_store = None  # the Statistics page opens the stats database itself
        self.swarm = None
        self.place = "this computer"  # where the worker runs, until the tray says
        self.gpu = GpuSupport("", False)
        self.reading = ""
        self.show_requested = None  # called with (page, link) when the tray asks to show the window
        self._apply(state)
        self.prefs_problem = state.get("prefs_problem")
        self.log_entries = [LogEntry(*e) for e in state.get("log", [])][-MAX_LOG:]
        channel.received.connect(self.on_message)

    def _apply(self, m: dict) -> None:
        """Take the parts of the tray's state that ``m`` carries."""
        if "prefs" in m:
            self.prefs = prefs_mod.validate(m["prefs"])
        if "catalog" in m:
            self.catalog = catalog_child.decode(m["catalog"]) if m["catalog"] is not None else None
        if "hardware" in m:
            hw = m["hardware"]
            self.hardware = Hardware(**{**hw, "gpus": [Gpu(**g) for g in hw["gpus"]]}) if hw else None
            self.idle_text = str(m.get("idle", ""))
        if "worker_place" in m:
            self.place = str(m["worker_place"])
        if "gpu_reading" in m:
            self.reading = str(m["gpu_reading"])
        if "gpu_support" in m:
            text, can_install = m["gpu_support"]
            self.gpu = GpuSupport(str(text), bool(can_install))
        if "swarm" in m:
            from dedloc_core.stats.swarmview import SwarmSummary

            self.swarm = msgspec.convert(m["swarm"], SwarmSummary) if m["swarm"] is not None else None
        if "status" in m:
            self.status = Status(*m["status"])
            self.joined = msgspec.convert(m["joined"], Experiment) if m["joined"] else None
            self.last_progress = protocol.decode_event(m["progress"]) if m["progress"] else None
            self.worker_state = protocol.decode_event(m["worker_state"]) if m["worker_state"] else None
            self.invite_problems = {str(k): str(v) for k, v in m.get("invite_problems", {}).items()}

    def on_message(self, m: dict) -> None:
        try:
            self._handle(m)
        except (KeyError, TypeError, ValueError) as exc:  # a tray of another version: say it, go on
            logger.warning("Bad %r message from the tray: %s", m.get("t"), str(exc)[:300])

    def _handle(self, m: dict) -> None:
        kind = m["t"]
        self._apply(m)
        if kind == "status":
            self.status_changed.emit(self.status)
        elif kind == "progress":
            self.progress.emit(self.last_progress)
        elif kind == "joined":
            self.joined_changed.emit(self.joined.id if self.joined else None)
        elif kind == "catalog":
            self.catalog_changed.emit(self.catalog)
        elif kind == "hardware":
            self.hardware_changed.emit(self.hardware)
        elif kind == "prefs":
            self.prefs_changed.emit(self.prefs)
        elif kind == "prefs_warning":
            self.prefs_warning.emit(str(m["text"]))
        elif kind == "log":
            entry = LogEntry(*m["entry"])
            self.log_entries.append(entry)
            del self.log_entries[:-MAX_LOG]
            self.logged.emit(entry)
        elif kind == "stats":
            self.stats_changed.emit()
        elif kind == "swarm":
            self.swarm_changed.emit(self.swarm)
        elif kind == "peer_id":
            self.peer_id_changed.emit(m["peer_id"])
        elif kind == "worker_place":
            self.worker_place_changed.emit(self.place)
        elif kind == "gpu_support":
            self.gpu_support_changed.emit(self.gpu)
        elif kind == "gpu_reading":
            self.gpu_reading_changed.emit(self.reading)
        elif kind == "show" and self.show_requested is not None:
            self.show_requested(m.get("page"), m.get("link"))
        elif kind == "quit":
            self.quitting.emit()

    def idle_source_text(self) -> str:
        return self.idle_text

    def worker_place(self) -> str:
        return self.place

    def gpu_support(self) -> GpuSupport:
        return self.gpu

    def gpu_reading(self) -> str:
        return self.reading

    def install_gpu_support(self) -> None:
        self.channel.send("install_gpu_support")

    # ---- what the user does: carried out by the tray -------------------------------------------

    def join(self, experiment_id: str) -> bool:
        self.channel.send("join", id=experiment_id)
        return True

    def leave(self) -> None:
        self.channel.send("leave")

    def refresh_catalog(self) -> None:
        self.channel.send("refresh_catalog")

    def refresh_stats(self) -> None:
        self.channel.send("refresh_stats")

    def save_prefs(self, new: Preferences) -> None:
        self.prefs = new
        self.prefs_changed.emit(new)
        self.channel.send("save_prefs", prefs=prefs_mod.to_json(new))

    def add_source(self, url: str, key: str, name: str) -> None:
        self.channel.send("add_source", url=url, key=key, name=name)

    def remove_source(self, url: str) -> None:
        self.channel.send("remove_source", url=url)

    def join_with_invite(self, experiment_id: str, code: str) -> None:
        self.channel.send("join_with_invite", id=experiment_id, code=code)


def connect(name: str | None = None, timeout_ms: int = 5000) -> Channel | None:
    """Connect to the running tray app as its window (None: no app runs)."""
    socket = QLocalSocket()
    socket.connectToServer(name or default_name())
    if not socket.waitForConnected(timeout_ms):
        return None
    socket.write(b"window\n")
    return Channel(socket)


def when_ready(channel: Channel, then: Callable[[dict], None]) -> None:
    """Call ``then(state)`` with the tray's state, its first message (the next ones follow it)."""

    def first(message: dict) -> None:
        channel.received.disconnect(first)
        if message["t"] == "state":
            then(message)
        else:
            channel.close()

    channel.received.connect(first)


def open_window(channel: Channel, state: dict, done: Callable[[], None]):
    """The main window over ``channel``; ``done()`` when it closes or the tray quits (the process
    then exits)."""
    from .firstrun import first_run
    from .window import MainWindow

    qapp = QApplication.instance()
    controller = RemoteController(channel, Bridge(qapp), state)
    window = MainWindow(controller)
    window.quit_on_close = True
    window.on_quit = done

    def show(page: str | None, link: str | None) -> None:
        window.bring_up()
        if link:
            window.show_page("Experiments").open_add_dialog(link)
        elif page in window.pages:
            window.show_page(page)

    controller.show_requested = show
    controller.quitting.connect(done)
    first_run(controller, window)
    return window, controller


def main(name: str | None = None) -> int:
    qapp = QApplication.instance() or QApplication(sys.argv[:1])
    qapp.setApplicationName("DeDLOC Volunteer")
    channel = connect(name)
    if channel is None:
        print("DeDLOC Volunteer is not running (start it with `dedloc app`).", file=sys.stderr)
        return 1
    opened: list = []
    when_ready(channel, lambda state: opened.append(open_window(channel, state, lambda: qapp.exit(0))))
    channel.closed.connect(lambda: qapp.exit(0 if opened else 1))
    QTimer.singleShot(60_000, lambda: opened or qapp.exit(1))  # the tray never answered
    code = qapp.exec()
    if opened:
        opened[0][1].bridge.shutdown()
    return code
