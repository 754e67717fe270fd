"""The app on a real GNOME Shell (mutter 43 in X11 mode on Xvfb, with Debian's AppIndicator
extension): the tray icon is a StatusNotifierItem that the shell hosts, its menu the app's; Mutter's
IdleMonitor is the app's idle source, and the user's first input pauses the worker through its
user-active watch. Screenshots in artifacts/gnome/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from desktop import gnome_session, stop, xdotool

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # the in-process app; the tray test's app runs on xcb
ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "artifacts" / "gnome"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MENU = """
import json, sys
from jeepney import DBusAddress, Properties, new_method_call
from jeepney.io.blocking import open_dbus_connection

bus = open_dbus_connection(bus="SESSION")
watcher = DBusAddress("/StatusNotifierWatcher", bus_name="org.kde.StatusNotifierWatcher",
                      interface="org.kde.StatusNotifierWatcher")
items = bus.send_and_get_reply(Properties(watcher).get("RegisteredStatusNotifierItems")).body[0][1]
found = []
for item in items:
    name, _, path = item.partition("@") if "@" in item else item.partition("/")  # ":1.12@/Path" (the shell's)
    sni = DBusAddress("/" + path.lstrip("/") if path else "/StatusNotifierItem", bus_name=name,
                      interface="org.kde.StatusNotifierItem")
    menu_path = bus.send_and_get_reply(Properties(sni).get("Menu")).body[0][1]
    title = bus.send_and_get_reply(Properties(sni).get("Title")).body[0][1]
    menu = DBusAddress(menu_path, bus_name=name, interface="com.canonical.dbusmenu")
    layout = bus.send_and_get_reply(new_method_call(menu, "GetLayout", "iias", (0, -1, []))).body[1]
    labels = [child[1][1]["label"][1] for child in layout[2]
              if "label" in child[1][1] and child[1][1].get("visible", ("b", True))[1]]  # as the shell shows it
    found.append({"title": title, "labels": labels})
print(json.dumps(found))
"""

SHOT = """
import sys
from PySide6.QtGui import QGuiApplication
app = QGuiApplication(["shot", "-platform", "xcb"])
sys.exit(0 if app.primaryScreen().grabWindow(0).save(sys.argv[1]) else 1)
"""


def screenshot(env: dict[str, str], name: str) -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / name
    subprocess.run([sys.executable, "-c", SHOT, str(path)], env=env, check=True, timeout=60)
    return path


def _image(path: Path):
    from PySide6.QtGui import QImage

    return QImage(str(path))


def icon_in_top_bar(shot: Path) -> tuple[int, int]:
    """The centre of the app's icon in the shell's top bar: the pixels of its idle grey (icons.COLORS)."""
    image, found = _image(shot), []
    for y in range(0, 32):
        for x in range(image.width() * 3 // 4, image.width() - 40):  # right of the clock, left of the system menu
            c = image.pixelColor(x, y)
            if abs(c.red() - 0x8a) < 30 and abs(c.green() - 0x8f) < 30 and abs(c.blue() - 0x98) < 30:
                found.append((x, y))
    assert len(found) > 20, "the app's icon is not in the top bar"
    return sum(p[0] for p in found) // len(found), sum(p[1] for p in found) // len(found)


def changed_below(after: Path, before: Path, x: int) -> bool:
    """Whether the area under the icon (where the shell draws the menu) differs between two shots."""
    a, b = _image(after), _image(before)
    changed = sum(a.pixelColor(px, py) != b.pixelColor(px, py)
                  for py in range(40, 300, 4) for px in range(max(0, x - 250), min(a.width(), x + 50), 4))
    return changed > 500


def test_the_tray_icon_and_its_menu_under_gnome_shell(tmp_path):
    with gnome_session(tmp_path / "gnome") as session:
        home = tmp_path / "dedloc"
        (home / "config").mkdir(parents=True)
        (home / "config" / "preferences.json").write_text(json.dumps({"version": 1, "consent": True}))
        env = {**session, "DEDLOC_HOME": str(home), "QT_QPA_PLATFORM": "xcb"}
        app = subprocess.Popen([sys.executable, "-m", "app", "--hidden"], env=env, cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=open(tmp_path / "app.log", "w"))
        try:
            deadline, found = time.monotonic() + 90, []
            while not found:
                out = subprocess.run([sys.executable, "-c", MENU], env=env, capture_output=True, text=True, timeout=30)
                found = json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip() else []
                if time.monotonic() > deadline or app.poll() is not None:
                    pytest.fail("no tray icon registered with GNOME Shell: " + out.stderr[-2000:]
                                + (tmp_path / "app.log").read_text()[-2000:])
                time.sleep(0.5)
            assert len(found) == 1, found
            labels = found[0]["labels"]  # nothing joined yet: the state, Snooze, Open window, Quit; no Pause
            assert labels == ["Not contributing: no experiment joined", "Snooze 1 hour", "Open window", "Quit"], labels
            xdotool(env["DISPLAY"], "key", "Escape")  # out of the overview the shell starts in
            time.sleep(1.0)
            x, y = icon_in_top_bar(screenshot(env, "top-bar-with-tray-icon.png"))
            xdotool(env["DISPLAY"], "mousemove", str(x), str(y), "click", "1")  # the shell opens the app's menu
            time.sleep(1.5)
            opened = screenshot(env, "tray-menu-open.png")
            assert changed_below(opened, SHOTS / "top-bar-with-tray-icon.png", x), "no menu opened under the icon"
        finally:
            stop(app, 30)


def test_mutters_idle_monitor_drives_the_pause(tmp_path, monkeypatch, qtbot, signed_catalog_server, spawn_worker):
    """The in-process app on the GNOME session's bus: its idle source is Mutter's IdleMonitor; away,
    it trains; the first mouse move pauses the worker through Mutter's user-active watch (the app's
    periodic poll stopped), within two seconds."""
    from conftest import APP_SWARM_BATCH, start_command
    from PySide6.QtWidgets import QApplication

    from app.main import build

    seed = spawn_worker("seed")
    seed.send(start_command(signed_catalog_server, seed.home, seed=7, target_batch_size=APP_SWARM_BATCH))
    state = seed.wait_for(lambda e: getattr(e, "state", None) == "training", 120)
    assert state is not None, "the seed peer did not start"
    monkeypatch.setenv("DEDLOC_INITIAL_PEERS", " ".join(state.maddrs))
    home = tmp_path / "dedloc"
    monkeypatch.setenv("DEDLOC_HOME", str(home))
    monkeypatch.setenv("DEDLOC_LISTEN", "/ip4/127.0.0.1/tcp/0")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))
    (home / "config").mkdir(parents=True)
    (home / "config" / "preferences.json").write_text(json.dumps(
        {"version": 1, "consent": True, "idle_minutes": 0.5, "other_cpu_limit": None}))
    with gnome_session(tmp_path / "gnome") as session:
        for name in ("DISPLAY", "DBUS_SESSION_BUS_ADDRESS"):
            monkeypatch.setenv(name, session[name])
        app = build(QApplication.instance(), tray=False)
        try:
            app.controller.start()
            qtbot.waitUntil(lambda: (app.controller.idle_source or "").startswith("GNOME Mutter")
                            and app.controller.catalog is not None, timeout=30000)
            xdotool(session["DISPLAY"], "mousemove", "10", "10")
            assert app.controller.join("tiny-lm-test")
            qtbot.waitUntil(lambda: app.controller.status.text == "Paused: you are using the computer", timeout=10000)
            qtbot.waitUntil(lambda: app.controller.status.state == "training"
                            and app.controller.last_progress is not None, timeout=240000)
            app.controller._tick.stop()  # only Mutter's watch can bring the pause now
            qtbot.wait(300)
            returned = time.monotonic()
            xdotool(session["DISPLAY"], "mousemove_relative", "--", "30", "20")
            qtbot.waitUntil(lambda: app.controller.worker_state.state == "paused", timeout=5000)
            took = time.monotonic() - returned
            app.controller._tick.start()
            assert app.controller.status.text == "Paused: you are using the computer"
            assert took < 2.0, f"the worker paused {took:.2f} s after the user came back"
            print(f"\nGNOME: paused {took * 1000:.0f} ms after the mouse moved")
            screenshot(dict(os.environ), "desktop-while-paused.png")
        finally:
            done = []
            app.controller.quit(lambda: done.append(True))
            qtbot.waitUntil(lambda: bool(done), timeout=60000)
            app.bridge.shutdown()
