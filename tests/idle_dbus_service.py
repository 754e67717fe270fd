"""A small real D-Bus service that answers the idle queries of GNOME, KDE, freedesktop and logind,
for tests on machines without those desktops. Run: ``python idle_dbus_service.py BUS_ADDRESS NAME...``.

Idle time is the time since start or since the last ``Poke`` call (interface ``test.Idle``, any
path), which stands in for user input. Mutter's user-active watches (``AddUserActiveWatch``) fire
``WatchFired`` at the next ``Poke`` and are dropped, as Mutter does. Prints ``ready`` once it owns its names.
"""

from __future__ import annotations

import sys
import time

from jeepney import DBusAddress, HeaderFields, MessageType, new_error, new_method_return, new_signal
from jeepney.bus_messages import message_bus
from jeepney.io.blocking import open_dbus_connection

IDLE_AFTER = 1.0  # logind: the session counts as idle after this many seconds without input
MUTTER = DBusAddress("/org/gnome/Mutter/IdleMonitor/Core", interface="org.gnome.Mutter.IdleMonitor")


def main(address: str, names: list[str]) -> None:
    conn = open_dbus_connection(bus=address)
    for name in names:
        reply = conn.send_and_get_reply(message_bus.RequestName(name, 4))  # 4: do not queue
        if reply.body[0] != 1:
            sys.exit(f"could not own {name}")
    last_input = time.monotonic()
    last_input_wall = time.time()
    watches: list[int] = []  # Mutter's user-active watches, fired at the next input
    next_watch = 1
    print("ready", flush=True)
    while True:
        msg = conn.receive()
        if msg.header.message_type != MessageType.method_call:
            continue
        fields = msg.header.fields
        member = fields.get(HeaderFields.member)
        interface = fields.get(HeaderFields.interface)
        idle_ms = int((time.monotonic() - last_input) * 1000)
        if interface == "test.Idle" and member == "Poke":
            last_input, last_input_wall = time.monotonic(), time.time()
            for watch in watches:
                conn.send(new_signal(MUTTER, "WatchFired", "u", (watch,)))
            watches.clear()
            conn.send(new_method_return(msg))
        elif member == "AddUserActiveWatch":  # Mutter
            watches.append(next_watch)
            conn.send(new_method_return(msg, "u", (next_watch,)))
            next_watch += 1
        elif member == "GetIdletime":  # Mutter
            conn.send(new_method_return(msg, "t", (idle_ms,)))
        elif member == "GetSessionIdleTime":  # KDE, freedesktop
            conn.send(new_method_return(msg, "u", (idle_ms,)))
        elif interface == "org.freedesktop.DBus.Properties" and member == "Get":
            prop = msg.body[1]
            idle = idle_ms / 1000 >= IDLE_AFTER
            if prop == "IdleHint":
                conn.send(new_method_return(msg, "v", (("b", idle),)))
            elif prop == "IdleSinceHint":
                since = int((last_input_wall + IDLE_AFTER) * 1e6) if idle else 0
                conn.send(new_method_return(msg, "v", (("t", since),)))
            else:
                conn.send(new_error(msg, "org.freedesktop.DBus.Error.UnknownProperty"))
        else:
            conn.send(new_error(msg, "org.freedesktop.DBus.Error.UnknownMethod"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
