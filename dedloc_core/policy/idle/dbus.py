"""Idle time over D-Bus (Wayland and other desktops without X11 idle time), with jeepney.

- ``MutterIdle``: GNOME (Mutter), ``org.gnome.Mutter.IdleMonitor.GetIdletime`` (milliseconds), and
  its ``AddUserActiveWatch`` for input as it happens.
- ``KdeIdle``: KDE Plasma's ``org.kde.screensaver`` ``GetSessionIdleTime`` (milliseconds).
- ``FreedesktopScreenSaverIdle``: ``org.freedesktop.ScreenSaver.GetSessionIdleTime`` as KDE and
  others implement it (milliseconds; GNOME Shell answers "not supported", so it is skipped there).
- ``LogindIdle``: systemd-logind's session ``IdleHint``/``IdleSinceHint`` on the system bus; coarse
  (the desktop sets the hint after its own idle delay), hence the last resort.

Each source keeps one blocking connection and answers a query in well under a millisecond;
a query that fails or takes longer than ``TIMEOUT`` gives None ("cannot tell").
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from .base import IdleSource, IdleUnavailable

logger = logging.getLogger(__name__)

TIMEOUT = 0.2


class _DBusSource(IdleSource):
    bus = "SESSION"
    bus_name = path = interface = method = ""

    def __init__(self, bus: str | None = None):
        try:
            from jeepney import DBusAddress
            from jeepney.io.blocking import open_dbus_connection
        except ImportError as exc:
            raise IdleUnavailable("jeepney is not installed") from exc
        try:
            self._conn = open_dbus_connection(bus=bus or self.bus)
        except Exception as exc:  # no bus, no address, refused
            raise IdleUnavailable(f"no D-Bus {bus or self.bus.lower()} bus: {exc}") from exc
        self._address = DBusAddress(self.path, bus_name=self.bus_name, interface=self.interface)

    def _call(self, message) -> tuple | None:
        from jeepney import MessageType

        try:
            reply = self._conn.send_and_get_reply(message, timeout=TIMEOUT)
        except Exception:  # timeout, closed connection
            return None
        if reply.header.message_type != MessageType.method_return:
            return None
        return reply.body

    def close(self) -> None:
        conn = getattr(self, "_conn", None)
        if conn is not None:
            try:
                conn.close()
            except OSError:
                pass
            self._conn = None


class _MillisecondsSource(_DBusSource):
    def seconds(self) -> float | None:
        from jeepney import new_method_call

        if self._conn is None:
            return None
        body = self._call(new_method_call(self._address, self.method))
        if not body:
            return None
        return float(body[0]) / 1000.0


class MutterIdle(_MillisecondsSource):
    name = "GNOME Mutter IdleMonitor (D-Bus)"
    bus_name = "org.gnome.Mutter.IdleMonitor"
    path = "/org/gnome/Mutter/IdleMonitor/Core"
    interface = "org.gnome.Mutter.IdleMonitor"
    method = "GetIdletime"
    _router = None

    def __init__(self, bus: str | None = None):
        super().__init__(bus)
        self._bus_for_watch = bus or self.bus
        self._watch_id: int | None = None  # Mutter's one-shot user-active watch, while armed

    def watch(self, on_input: Callable[[], None]) -> bool:
        """Mutter's ``AddUserActiveWatch``: it signals ``WatchFired`` at the first input, then drops
        the watch. The signal is read by a thread of jeepney's router (a connection of its own)."""
        from jeepney import MatchRule
        from jeepney.bus_messages import message_bus
        from jeepney.io.threading import DBusRouter, open_dbus_connection

        if self._router is not None:
            return True
        router = None
        try:
            router = DBusRouter(open_dbus_connection(bus=self._bus_for_watch))
            rule = MatchRule(type="signal", interface=self.interface, member="WatchFired", path=self.path)
            router.send_and_get_reply(message_bus.AddMatch(rule), timeout=TIMEOUT)
        except Exception as exc:  # no bus, a refused match: the poll still decides
            logger.info("No user-active watch from Mutter (%s): the idle time is polled only", exc)
            if router is not None:
                router.close()
                router.conn.close()
            return False
        self._router, self._fired, self._on_input = router, router.filter(rule, bufsize=16), on_input
        self._lock, self._early = threading.Lock(), collections.deque(maxlen=8)  # fired before arm() saw its id
        self._thread = threading.Thread(target=self._listen, name="mutter-input", daemon=True)
        self._thread.start()
        self.name += ", input events"
        return True

    def arm(self) -> None:
        from jeepney import new_method_call

        if self._router is None or self._watch_id is not None:
            return
        try:
            reply = self._router.send_and_get_reply(new_method_call(self._address, "AddUserActiveWatch"),
                                                    timeout=TIMEOUT)
            watch_id = int(reply.body[0])
        except Exception:  # an old Mutter, a slow bus: the poll decides
            logger.debug("AddUserActiveWatch failed", exc_info=True)
            return
        with self._lock:
            fired = watch_id in self._early  # input came before the reply did
            self._watch_id = None if fired else watch_id
        if fired:
            self._on_input()

    def _listen(self) -> None:
        while True:
            msg = self._fired.queue.get()
            if msg is None:  # closed
                return
            fired_id = msg.body[0] if msg.body else None
            with self._lock:
                fired = fired_id is not None and fired_id == self._watch_id
                if fired:
                    self._watch_id = None  # Mutter dropped it on firing
                elif fired_id is not None:
                    self._early.append(fired_id)
            if fired:
                try:
                    self._on_input()
                except Exception:  # the caller's bug: keep listening
                    logger.exception("Input callback failed")

    def close(self) -> None:
        if self._router is not None:
            self._fired.queue.put(None)
            self._thread.join(2)
            self._fired.close()
            self._router.close()
            self._router.conn.close()
            self._router = None
        super().close()


class KdeIdle(_MillisecondsSource):
    name = "KDE screensaver GetSessionIdleTime (D-Bus)"
    bus_name = "org.kde.screensaver"
    path = "/ScreenSaver"
    interface = "org.freedesktop.ScreenSaver"
    method = "GetSessionIdleTime"


class FreedesktopScreenSaverIdle(_MillisecondsSource):
    name = "org.freedesktop.ScreenSaver GetSessionIdleTime (D-Bus)"
    bus_name = "org.freedesktop.ScreenSaver"
    path = "/org/freedesktop/ScreenSaver"
    interface = "org.freedesktop.ScreenSaver"
    method = "GetSessionIdleTime"


class LogindIdle(_DBusSource):
    """logind's idle hint of this session: 0 while not idle, else seconds since ``IdleSinceHint``."""

    name = "systemd-logind IdleHint (D-Bus)"
    bus = "SYSTEM"
    bus_name = "org.freedesktop.login1"
    path = "/org/freedesktop/login1/session/auto"
    interface = "org.freedesktop.login1.Session"

    def seconds(self) -> float | None:
        from jeepney import Properties

        if self._conn is None:
            return None
        props = Properties(self._address)
        hint = self._call(props.get("IdleHint"))
        if not hint:
            return None
        if not hint[0][1]:
            return 0.0
        since = self._call(props.get("IdleSinceHint"))  # microseconds, wall clock
        if not since or not since[0][1]:
            return None
        return max(0.0, time.time() - since[0][1] / 1e6)
