"""Idle time over D-Bus (Wayland and other desktops without X11 idle time), with jeepney.

- ``MutterIdle``: GNOME (Mutter), ``org.gnome.Mutter.IdleMonitor.GetIdletime`` (milliseconds).
- ``KdeIdle``: KDE Plasma's ``org.kde.screensaver`` ``GetSessionIdleTime`` (milliseconds).
- ``FreedesktopScreenSaverIdle``: ``org.freedesktop.ScreenSaver.GetSessionIdleTime`` as KDE and
  others implement it (milliseconds; GNOME Shell answers "not supported", so it is skipped there).
- ``LogindIdle``: systemd-logind's session ``IdleHint``/``IdleSinceHint`` on the system bus; coarse
  (the desktop sets the hint after its own idle delay), hence the last resort.

Each source keeps one blocking connection and answers a query in well under a millisecond;
a query that fails or takes longer than ``TIMEOUT`` gives None ("cannot tell").
"""

from __future__ import annotations

import time

from .base import IdleSource, IdleUnavailable

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
