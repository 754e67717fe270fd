"""Idle sources against real servers: Xvfb (+ xdotool input) and a private D-Bus bus with a small
service standing in for GNOME, KDE, freedesktop and logind (tests/idle_dbus_service.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from desktop import dbus_session, need, xdotool, xvfb

from dedloc_core.policy import idle

SERVICE = Path(__file__).with_name("idle_dbus_service.py")
NAMES = ["org.gnome.Mutter.IdleMonitor", "org.kde.screensaver", "org.freedesktop.ScreenSaver",
         "org.freedesktop.login1"]


@pytest.fixture
def xdisplay(monkeypatch):
    """A real X server for this test; ``DISPLAY`` points at it."""
    with xvfb() as display:
        monkeypatch.setenv("DISPLAY", display)
        yield display


@pytest.mark.slow  # an X server
def test_x11_idle_grows_and_input_resets_it(xdisplay):
    need("xdotool")
    source = idle.X11Idle()
    assert "X11" in source.name
    xdotool(xdisplay, "mousemove", "10", "10")
    first = source.seconds()
    time.sleep(1.2)
    later = source.seconds()
    assert first is not None and later is not None
    assert later - first >= 1.0, (first, later)
    xdotool(xdisplay, "mousemove", "200", "300")
    assert source.seconds() < 0.2
    time.sleep(0.5)
    xdotool(xdisplay, "key", "a")
    assert source.seconds() < 0.2
    source.close()


@pytest.mark.slow  # an X server
def test_x11_input_events_reach_an_armed_watcher_once(xdisplay):
    """XInput 2 raw events: the first input after ``arm()`` calls back at once (no poll between),
    then the watcher is disarmed until armed again."""
    import threading

    need("xdotool")
    source = idle.X11Idle()
    calls: list[float] = []
    heard = threading.Event()

    def on_input():
        calls.append(time.monotonic())
        heard.set()

    try:  # (a watcher left open when Xvfb stops: Xlib exits the process)
        assert source.watch(on_input) and "input events" in source.name
        xdotool(xdisplay, "mousemove_relative", "10", "10")  # relative: device motion, as a mouse makes
        time.sleep(0.5)
        assert calls == []  # not armed: nothing
        for move in (("mousemove_relative", "30", "20"), ("key", "a"), ("click", "1")):
            heard.clear()
            source.arm()
            time.sleep(0.2)  # the watcher thread selects the events
            sent = time.monotonic()
            xdotool(xdisplay, *move)
            assert heard.wait(2), f"no call after {move}"
            assert calls[-1] - sent < 0.5
            count = len(calls)
            xdotool(xdisplay, "mousemove_relative", "5", "6")
            time.sleep(0.3)
            assert len(calls) == count  # disarmed after one call
    finally:
        source.close()
    assert not any(t.name == "x11-input" for t in threading.enumerate())


@pytest.mark.slow  # an X server
def test_detect_picks_x11_when_a_display_answers(xdisplay, monkeypatch):
    monkeypatch.delenv("DBUS_SESSION_BUS_ADDRESS", raising=False)
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", "unix:path=/nonexistent")
    source = idle.detect()
    assert isinstance(source, idle.X11Idle)
    source.close()


def test_x11_without_display_is_unavailable(monkeypatch):
    monkeypatch.setenv("DISPLAY", ":1999")
    with pytest.raises(idle.base.IdleUnavailable):
        idle.X11Idle()


def test_no_source_means_schedule_only(monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", "unix:path=/nonexistent")
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", "unix:path=/nonexistent")
    source = idle.detect()
    assert isinstance(source, idle.NullIdle)
    assert source.seconds() is None
    assert "schedule-only" in source.name


@pytest.fixture(scope="module")
def dbus_idle_service():
    """A private session bus with the stand-in service owning every idle name."""
    with dbus_session() as address:
        proc = subprocess.Popen([sys.executable, str(SERVICE), address, *NAMES], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            yield address
        finally:
            proc.terminate()
            proc.wait(5)


def poke(address: str) -> None:
    from jeepney import DBusAddress, new_method_call
    from jeepney.io.blocking import open_dbus_connection

    with open_dbus_connection(bus=address) as conn:
        conn.send_and_get_reply(new_method_call(DBusAddress("/", NAMES[0], "test.Idle"), "Poke"), timeout=5)


@pytest.mark.parametrize("cls", [idle.MutterIdle, idle.KdeIdle, idle.FreedesktopScreenSaverIdle])
def test_dbus_idle_time_grows_and_input_resets_it(dbus_idle_service, cls):
    source = cls(bus=dbus_idle_service)
    poke(dbus_idle_service)
    first = source.seconds()
    time.sleep(0.6)
    later = source.seconds()
    assert first is not None and first < 0.2
    assert 0.5 <= later - first < 2.0, (first, later)
    poke(dbus_idle_service)
    assert source.seconds() < 0.2
    source.close()


def test_mutter_user_active_watch_calls_an_armed_watcher_once(dbus_idle_service):
    """GNOME: Mutter's one-shot user-active watch (AddUserActiveWatch, then WatchFired at the next
    input) reaches the watcher's callback; unarmed, input calls nothing."""
    import threading

    source = idle.MutterIdle(bus=dbus_idle_service)
    heard = threading.Event()
    calls = []

    def on_input():
        calls.append(time.monotonic())
        heard.set()

    try:
        assert source.watch(on_input) and "input events" in source.name
        poke(dbus_idle_service)
        time.sleep(0.3)
        assert calls == []  # not armed
        for _ in range(2):
            heard.clear()
            source.arm()
            source.arm()  # armed already: no second watch
            sent = time.monotonic()
            poke(dbus_idle_service)
            assert heard.wait(2)
            assert calls[-1] - sent < 0.5
            count = len(calls)
            poke(dbus_idle_service)
            time.sleep(0.3)
            assert len(calls) == count  # the watch fired once and is gone
    finally:
        source.close()
    assert not any(t.name == "mutter-input" for t in threading.enumerate())


def test_logind_idle_hint(dbus_idle_service):
    source = idle.LogindIdle(bus=dbus_idle_service)
    poke(dbus_idle_service)
    assert source.seconds() == 0.0  # not idle yet: the hint is off
    time.sleep(1.5)
    idle_for = source.seconds()
    assert idle_for is not None and 0.2 < idle_for < 2.0
    poke(dbus_idle_service)
    assert source.seconds() == 0.0


def test_detect_finds_mutter_on_the_session_bus(dbus_idle_service, monkeypatch):
    monkeypatch.delenv("DISPLAY", raising=False)
    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", dbus_idle_service)
    source = idle.detect()
    assert isinstance(source, idle.MutterIdle)
    source.close()


def test_dbus_source_without_its_service_gives_none(monkeypatch):
    with dbus_session() as address:  # a bus where nobody owns the idle names
        source = idle.MutterIdle(bus=address)
        assert source.seconds() is None
        source.close()
        monkeypatch.delenv("DISPLAY", raising=False)
        monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", address)
        monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", "unix:path=/nonexistent")
        assert isinstance(idle.detect(), idle.NullIdle)


def test_candidates_per_platform():
    assert idle.candidates("win32") == [idle.WindowsIdle]
    assert idle.candidates("darwin") == [idle.MacIdle]
    assert idle.candidates("linux")[-1] is idle.LogindIdle
    with pytest.raises(idle.base.IdleUnavailable):
        idle.WindowsIdle() if sys.platform != "win32" else idle.MacIdle()
