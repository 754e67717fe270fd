"""The tray app (pytest-qt, offscreen): preferences form, broken files, catalog errors, single
instance, stale workers, and a real worker driven through the app's tray actions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from dedloc_core.protocol import Progress, State, Stats

pytest.importorskip("PySide6")
pytest.importorskip("pytestqt")

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh per-user home for the app (config, data, logs)."""
    monkeypatch.setenv("DEDLOC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg-config"))  # start-at-login entries
    monkeypatch.setenv("DEDLOC_LISTEN", "/ip4/127.0.0.1/tcp/0")  # test swarms live on loopback
    for name in ("DEDLOC_CATALOG_URL", "DEDLOC_TRUSTED_KEYS", "DEDLOC_INITIAL_PEERS"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    # This machine runs the other peers of each test swarm: their CPU must not count as "other
    # programs are busy" (the default pauses above 50 %).
    write_prefs(home, other_cpu_limit=None)
    return home


def write_prefs(home: Path, **fields) -> None:
    (home / "config").mkdir(parents=True, exist_ok=True)
    (home / "config" / "preferences.json").write_text(json.dumps({"version": 1, **fields}))


@pytest.fixture
def make_app(qtbot, home):
    from PySide6.QtWidgets import QApplication

    from app.main import build

    apps = []

    def make(**kwargs):
        app = build(QApplication.instance(), tray=True, **kwargs)
        apps.append(app)
        app.controller.start()
        qtbot.waitUntil(lambda: app.controller.catalog is not None and app.controller.hardware is not None,
                        timeout=15000)
        return app

    yield make
    for app in apps:
        done = []
        app.controller.quit(lambda d=done: d.append(True))
        qtbot.waitUntil(lambda d=done: bool(d), timeout=60000)
        app.bridge.shutdown()
        if app.tray is not None:
            app.tray.hide()


def test_gui_process_never_imports_torch_or_hivemind(tmp_path):
    code = """
import os, sys
os.environ["QT_QPA_PLATFORM"] = "offscreen"
from PySide6.QtWidgets import QApplication
from app.main import build
qapp = QApplication([])
app = build(qapp, tray=True)
app.controller.start()
app.window.show()
for name in app.window.pages:
    app.window.show_page(name)
    qapp.processEvents()
import time
end = time.time() + 3
while time.time() < end:
    qapp.processEvents()
    time.sleep(0.02)
heavy = ("torch", "hivemind", "transformers", "numpy", "cryptography")
print("heavy:" + ",".join(sorted(m for m in heavy if m in sys.modules)))
"""
    env = {**os.environ, "DEDLOC_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    heavy = next(line for line in out.stdout.splitlines() if line.startswith("heavy:"))
    assert "torch" not in heavy and "hivemind" not in heavy, heavy
    # Catalog signatures are checked in a child process: no cryptography in the tray either.
    assert "cryptography" not in heavy, heavy


def test_preferences_form_round_trip(make_app, home, qtbot):
    app = make_app()
    page = app.window.show_page("Contribution")
    page.widgets["idle_minutes"].setValue(7.5)
    page.widgets["upload_cap_kbs"].setValue(300)
    page.widgets["schedule"].setText("Mon-Fri 22:00-07:00")
    page.widgets["idle_only"].setChecked(False)
    assert page.save()
    app.bridge.drain()
    path = home / "config" / "preferences.json"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and "idle_minutes" not in path.read_text():
        time.sleep(0.05)  # saved on a background thread
    saved = json.loads(path.read_text())
    assert saved["idle_minutes"] == 7.5 and saved["upload_cap_kbs"] == 300 and saved["idle_only"] is False
    assert saved["schedule"][0]["days"] == [0, 1, 2, 3, 4] and saved["download_cap_kbs"] is None
    # Start at login: the XDG autostart entry appears, and goes when switched off again.
    entry = home.parent / "xdg-config" / "autostart"
    page.widgets["start_at_login"].setChecked(True)
    assert page.save()
    qtbot.waitUntil(lambda: any(entry.glob("*.desktop")), timeout=5000)
    desktop = next(entry.glob("*.desktop")).read_text()
    assert "app --hidden" in desktop or "app\" --hidden" in desktop, desktop
    page.widgets["start_at_login"].setChecked(False)
    assert page.save()
    qtbot.waitUntil(lambda: not any(entry.glob("*.desktop")), timeout=5000)
    qtbot.waitUntil(lambda: json.loads(path.read_text())["start_at_login"] is False, timeout=5000)
    saved = json.loads(path.read_text())
    # A bad value is refused with a message, and nothing changes on disk.
    page.widgets["schedule"].setText("Someday 10:00-11:00")
    assert not page.save()
    assert "Not saved" in page.message.text() and "Someday" in page.message.text()
    assert json.loads(path.read_text()) == saved
    # A new app reads the saved preferences into its form.
    again = make_app()
    assert again.window.pages["Contribution"].widgets["upload_cap_kbs"].value() == 300


def test_broken_preferences_file_is_kept_aside_and_shown(make_app, home):
    (home / "config" / "preferences.json").write_text('{"idle_minutes": "soon"')
    app = make_app()
    assert app.controller.prefs.idle_minutes == 3.0
    assert any("defaults are in use" in t for t in app.window.banner_texts())
    assert list((home / "config").glob("preferences.json.broken-*"))
    assert any("defaults" in e.message for e in app.controller.log_entries)


def test_tampered_catalog_is_shown_with_last_good_listed(make_app, corpus_server, monkeypatch):
    good = json.loads(Path(__file__).parent.parent.joinpath("resources", "catalog", "default.json").read_text())
    good["payload"] = good["payload"].replace("Tiny LM (demo)", "Tiny LM (hacked)")
    corpus_server.add("/tampered.json", json.dumps(good).encode())
    monkeypatch.setenv("DEDLOC_CATALOG_URL", f"{corpus_server.url}tampered.json")
    app = make_app()
    page = app.window.show_page("Experiments")
    assert page.error.isVisibleTo(app.window) and "altered after signing" in page.error.text()
    titles = [page.list.item(i).text() for i in range(page.list.count())]
    assert any("Tiny LM (demo)" in t for t in titles) and not any("hacked" in t for t in titles)


def test_second_launch_shows_the_first_window(qtbot):
    from app.instance import SingleInstance

    name = f"dedloc-test-{os.getpid()}-{time.monotonic_ns()}"
    first, shown, links = SingleInstance(name), [], []
    assert first.listen(shown.append, links.append)
    try:
        assert SingleInstance(name).notify_running()
        qtbot.waitUntil(lambda: bool(shown), timeout=5000)
        # `dedloc app dedloc://add?...` (the desktop's scheme handler) hands the link to the running app
        assert SingleInstance(name).notify_running(link="dedloc://add?url=https%3A%2F%2Fx%2Fc.json&key=k")
        qtbot.waitUntil(lambda: bool(links), timeout=5000)
        assert links == ["dedloc://add?url=https%3A%2F%2Fx%2Fc.json&key=k"] and shown == [None]
        assert SingleInstance(name).notify_running(page="Statistics")
        qtbot.waitUntil(lambda: len(shown) == 2, timeout=5000)
        assert shown[1] == "Statistics"
    finally:
        first.close()
    assert not SingleInstance(name).notify_running(timeout_ms=300)


def test_stale_worker_is_reaped_at_start(qtbot, home):
    from PySide6.QtWidgets import QApplication

    from app.bridge import Bridge
    from app.supervisor import Supervisor
    from dedloc_core.workerproc import WorkerProcess

    stale = WorkerProcess()  # a worker whose app crashed: nobody will stop it
    stale.start()
    pid = stale.pid
    pid_file = home / "data" / "worker.pid"
    pid_file.parent.mkdir(parents=True, exist_ok=True)
    left = Path(stale.socket_dir) / "hivemind-p2pd-stale.sock"  # what a killed worker's p2pd leaves
    left.touch()
    pid_file.write_text(json.dumps({"pid": pid, "create_time": psutil.Process(pid).create_time(),
                                    "socket_dir": stale.socket_dir}))
    bridge = Bridge(QApplication.instance())
    Supervisor(bridge, pid_file=pid_file)
    qtbot.waitUntil(lambda: stale.proc.poll() is not None and not pid_file.exists(), timeout=15000)
    assert not left.parent.exists()
    bridge.shutdown()


@pytest.mark.slow
def test_real_worker_through_the_tray(make_app, qtbot, signed_catalog_server, spawn_worker, monkeypatch):
    """Join -> progress shown -> pause from the tray -> no more samples -> resume -> snooze ->
    a crashed worker is restarted -> Quit leaves no process."""
    from conftest import APP_SWARM_BATCH, start_command

    seed = spawn_worker("seed")  # another volunteer already in the swarm
    seed.send(start_command(signed_catalog_server, seed.home, seed=7, target_batch_size=APP_SWARM_BATCH))
    state = seed.wait_for(lambda e: getattr(e, "state", None) == "training", 120)
    assert state is not None, "the seed peer did not start"
    monkeypatch.setenv("DEDLOC_INITIAL_PEERS", " ".join(state.maddrs))

    app = make_app()
    stats: list[Stats] = []
    app.supervisor.stats.connect(stats.append)
    page = app.window.show_page("Experiments")
    assert app.controller.join("tiny-lm-test")
    qtbot.waitUntil(lambda: app.controller.status.state == "training" and app.controller.last_progress is not None,
                    timeout=180000)
    qtbot.waitUntil(lambda: "global step" in page.details.text(), timeout=10000)
    assert "Connection:</b> direct" in page.details.text()  # loopback: reachable without asking
    assert "samples/s" in app.tray.status_action.text() and "Training tiny-lm" in app.tray.toolTip()

    # Pause from the tray: the worker pauses and accumulates no more samples.
    app.tray.pause_action.trigger()
    qtbot.waitUntil(lambda: app.controller.worker_state.state == "paused", timeout=10000)
    assert app.controller.status.text == "Paused by you" and app.tray.resume_action.isVisible()
    qtbot.wait(1500)
    held = stats[-1].samples
    qtbot.wait(2500)
    assert stats[-1].samples == held, "samples grew while paused"

    # Resume: samples grow again.
    app.tray.resume_action.trigger()
    qtbot.waitUntil(lambda: stats[-1].samples > held, timeout=30000)

    # Snooze one hour: paused with the time in the reason.
    app.tray.snooze_action.trigger()
    qtbot.waitUntil(lambda: app.controller.worker_state.state == "paused", timeout=10000)
    assert app.controller.status.text.startswith("Snoozed until ") and app.controller.status.state == "snoozed"
    app.tray.resume_action.trigger()
    qtbot.waitUntil(lambda: app.controller.worker_state.state == "training", timeout=10000)

    # A crash (SIGKILL of the worker's whole process group) is shown and the worker restarted.
    app.supervisor.backoff = (0.5,)
    crashed = app.supervisor.worker
    os.killpg(crashed.pid, 9)
    qtbot.waitUntil(lambda: any("stopped unexpectedly" in e.message for e in app.controller.log_entries),
                    timeout=15000)
    qtbot.waitUntil(lambda: app.supervisor.worker is not None and app.supervisor.worker.pid != crashed.pid
                    and app.controller.status.state == "training", timeout=180000)

    # Quit from the tray: the worker and its whole process tree are gone.
    worker = app.supervisor.worker
    tree = [worker.proc.pid, *(c.pid for c in psutil.Process(worker.pid).children(recursive=True))]
    assert len(tree) > 1  # hivemind's helpers and p2pd
    exits = []
    app.qapp = type("QAppExit", (), {"exit": staticmethod(exits.append)})()  # keep pytest-qt's QApplication
    app.tray.quit_action.trigger()
    qtbot.waitUntil(lambda: exits == [0], timeout=60000)

    def alive() -> list[str]:
        names = []
        for pid in tree:
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE:
                    names.append(f"{pid} {proc.name()}")
            except psutil.NoSuchProcess:
                pass
        return names

    deadline = time.monotonic() + 15  # torch_shm_manager leaves by itself once its clients are gone
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(), alive()
    # What the worker did is in the statistics database (the recorder flushed at quit).
    from dedloc_core.stats.db import StatsStore

    total = StatsStore(app.controller.stats_store.path).totals()
    # (Totals add up every worker of the test: the crashed one's and its replacement's. Whether a
    # round happened in these few seconds depends on the pace of the swarm; test_swarm.py checks
    # rounds, here the recorder must not lose any the last worker reported.)
    # The file counts samples computed less those a state load dropped (StatsRecorder): a replacement
    # that joined late and loaded the swarm's state dropped its first ones (CI: 24 computed, 16 dropped).
    counted = stats[-1].samples - stats[-1].samples_dropped
    assert stats[-1].samples > 0 and total.samples >= counted and total.rounds >= stats[-1].rounds, total
    assert total.bytes_sent >= stats[-1].bytes_sent > 0 and total.paused.get("Paused by you", 0) > 0, total


def workers_of(home: Path) -> list[int]:
    """Pids of the worker processes (``dedloc_core.engine.worker``) this app started for ``home``
    (not their forked helpers, which carry the same command line)."""
    pids = []
    for proc in psutil.process_iter(["pid", "ppid", "cmdline"]):
        try:
            if proc.info["ppid"] == os.getpid() and "dedloc_core.engine.worker" in (proc.info["cmdline"] or []) \
                    and proc.environ().get("DEDLOC_HOME") == str(home):
                pids.append(proc.pid)
        except psutil.Error:
            continue
    return pids


class LastFirst:
    """The app's bridge, whose threads start the first of two calls' work after the second's."""

    def __init__(self, bridge):
        self.bridge, self.calls, self.second = bridge, 0, threading.Event()

    def __getattr__(self, name):
        return getattr(self.bridge, name)

    def run(self, work, done=None, failed=None):
        self.calls += 1
        if self.calls == 1:
            def late():
                self.second.wait(10)
                time.sleep(0.3)
                return work()
            return self.bridge.run(late, done, failed)

        def early():
            self.second.set()
            return work()
        return self.bridge.run(early, done, failed)


def test_join_runs_one_worker_at_a_time(make_app, qtbot, home, signed_catalog_server):
    """Join saves the choice (which asks the policy at once) and the next tick asks again; a second
    click on Join comes too. Only one worker may run: two share the peer identity, and the second
    one's DHT is refused ("identity ... already taken by another peer", a CI failure)."""
    app = make_app()
    assert app.controller.join("tiny-lm-test")
    assert app.controller.join("tiny-lm-test")  # a double click
    seen: set[int] = set()
    most = 0
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and app.controller.status.state != "training":
        qtbot.wait(100)
        pids = workers_of(home)
        seen.update(pids)
        most = max(most, len(pids))
    assert app.controller.status.state == "training", app.controller.status
    assert most == 1 and len(seen) == 1, (most, seen)

    # Two relaunches in a row (a restart timer and a new join): the second comes before the GUI
    # thread has heard of the first's worker, and must still stop it first. The bridge's threads
    # take up the two in reverse order (they race: the first relaunch can stop the second's worker).
    first = app.supervisor.worker.pid
    app.supervisor.bridge = LastFirst(app.bridge)
    app.supervisor.join(app.supervisor.wanted)
    app.supervisor.join(app.supervisor.wanted)
    most = 0
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not (app.supervisor.running() and app.supervisor.worker.pid != first
                                               and app.controller.status.state == "training"):
        qtbot.wait(100)
        pids = workers_of(home)
        seen.update(pids)
        most = max(most, len(pids))
    assert app.controller.status.state == "training", app.controller.status
    assert most == 1, (most, seen)
    assert not [e for e in app.controller.log_entries if e.level == "ERROR"], app.controller.log_entries


def test_a_pause_while_the_worker_starts_takes_effect_at_once(make_app, qtbot, home, signed_catalog_server):
    """Importing torch and hivemind is seconds of CPU that no pause command interrupts: paused while
    it starts, the worker process is stopped (SIGSTOP) until resume, then joins and trains."""
    app = make_app()
    assert app.controller.join("tiny-lm-test")
    qtbot.waitUntil(lambda: app.supervisor.running(), timeout=60000)  # said hello, now importing
    state = app.supervisor.last_state
    assert state is None or state.state in ("idle", "preparing"), state
    app.controller.pause()
    worker = psutil.Process(app.supervisor.worker.pid)
    used = sum(worker.cpu_times()[:2])
    qtbot.wait(1500)
    assert sum(worker.cpu_times()[:2]) - used < 0.05
    assert worker.status() == psutil.STATUS_STOPPED
    app.controller.resume()
    qtbot.waitUntil(lambda: app.controller.status.state == "training", timeout=180000)
    assert app.supervisor.worker.pid == worker.pid  # the same worker, thawed


def test_the_computer_page_offers_gpu_support_where_a_gpu_is_and_installs_it(make_app, qtbot, home, tmp_path,
                                                                             monkeypatch):
    """A GPU found (a named test double: this machine has none) and a runtime published: the page
    says how much it downloads and installs it from a real HTTP index; with no GPU it offers nothing."""
    from test_gpu_runtime import listing, make_wheel

    from dedloc_core import gpu_runtime
    from dedloc_core.organizer.httpserve import FileServer
    from dedloc_core.policy.hardware import Gpu, Hardware

    index = tmp_path / "index"
    index.mkdir()
    wheel = make_wheel(index, "gpupkg", "1.0", "V = 1\n")
    server = FileServer()
    server.serve_dir("/simple/", index)
    with server:
        pinned = listing(tmp_path / "list.json", server.url + "simple/", {"rt-test": [wheel]})
        real = gpu_runtime.load_list
        monkeypatch.setattr(gpu_runtime, "load_list", lambda path=None: real(path or pinned))
        app = make_app()
        page = app.window.show_page("This computer")
        with_gpu = Hardware("a CPU", 8, 16, 64.0, 500.0, gpus=[Gpu("GeForce RTX 3080", 10240, "550.54")])
        app.controller._on_hardware(with_gpu)
        assert page.gpu_label.text() == "GPU found; GPU support not installed (download 0.0 GB)"
        assert page.install_button.isVisibleTo(page)
        page.install_button.click()
        qtbot.waitUntil(lambda: page.gpu_label.text() == "GPU support installed (rt-test)", timeout=30000)
        assert not page.install_button.isVisibleTo(page)
        assert gpu_runtime.current(home / "data" / "gpu-runtime").name == "rt-test"
        assert any(e.message == "GPU support installed (rt-test)" for e in app.controller.log_entries)
    app.controller._on_hardware(Hardware("a CPU", 8, 16, 64.0, 500.0, gpus=[]))
    assert not page.gpu_label.isVisibleTo(page) and not page.install_button.isVisibleTo(page)


def test_the_contribution_page_shows_the_gpu_temperature_beside_its_limit(make_app, qtbot, home, signed_catalog_server):
    """The reading the temperature cap is held against (a named test double for NVML: no GPU here),
    and, above the limit, that the GPU is off until 5 °C cooler."""
    from dedloc_core.policy.idle import NullIdle
    from dedloc_core.policy.sampler import FixedGpuProbe, Sampler

    write_prefs(home, consent=True, idle_only=False, other_cpu_limit=None, gpu_temp_limit_c=70)
    app = make_app()
    page = app.window.show_page("Contribution")
    assert not page.gpu_reading.isVisibleTo(page)  # no reading yet
    probe = FixedGpuProbe(temperature=71.0)
    app.controller.contributor.sampler = Sampler(NullIdle(), probe, own_pids=lambda: [], slow_period=0.0)
    assert app.controller.join("tiny-lm-test")
    qtbot.waitUntil(lambda: page.gpu_reading.text() == "GPU at 71 °C now: off until it is 65 °C", timeout=5000)
    assert page.gpu_reading.isVisibleTo(page)
    probe.temp = 66.0  # cooler, not yet 5 °C under the limit: still off
    qtbot.waitUntil(lambda: page.gpu_reading.text() == "GPU at 66 °C now: off until it is 65 °C", timeout=5000)
    probe.temp = 60.0
    qtbot.waitUntil(lambda: page.gpu_reading.text() == "GPU at 60 °C now", timeout=5000)


def test_a_worker_started_through_its_own_command_is_paused_by_command_and_shown(
        make_app, qtbot, home, signed_catalog_server, tmp_path):
    """A worker across a boundary (the "Run the worker with" preference): no signal reaches it, so a
    pause while it starts goes through the protocol; its identity is its own; the window says where
    it runs. ``env`` stands in for ssh or wsl.exe: it execs the worker with a data folder of its own."""
    import socket

    far = tmp_path / "far"
    write_prefs(home, consent=True, idle_only=False,
                worker_command=f"env DEDLOC_HOME={far} {sys.executable} -m dedloc_core.engine.worker")
    app = make_app()
    assert app.controller.join("tiny-lm-test")
    qtbot.waitUntil(lambda: app.supervisor.running(), timeout=60000)
    app.controller.pause()
    worker = psutil.Process(app.supervisor.worker.pid)
    qtbot.wait(500)
    assert worker.status() != psutil.STATUS_STOPPED  # not frozen: the pause command holds it
    qtbot.waitUntil(lambda: getattr(app.controller.worker_state, "state", None) == "paused", timeout=120000)
    assert not (far / "data" / "identity.key").exists()  # held before it joined
    app.controller.resume()
    qtbot.waitUntil(lambda: app.controller.status.state == "training", timeout=180000)
    assert (far / "data" / "identity.key").exists() and not (home / "data" / "identity.key").exists()
    page = app.window.show_page("This computer")
    qtbot.waitUntil(lambda: f"(host {socket.gethostname()})" in page.label.text(), timeout=10000)
    assert f"through env DEDLOC_HOME={far}" in page.label.text()


@pytest.mark.timeout(600)
def test_the_worker_runs_while_away_and_pauses_when_the_user_returns(
        make_app, qtbot, home, signed_catalog_server, spawn_worker, monkeypatch):
    """The policy through the app on a real X server: present (recent input) -> nothing starts;
    30 s without input -> the worker trains; a mouse move -> paused within about a second, through
    the X server's input events."""
    from conftest import APP_SWARM_BATCH, start_command
    from desktop import need, xvfb

    need("Xvfb", "xdpyinfo", "xdotool")
    seed = spawn_worker("seed")
    seed.send(start_command(signed_catalog_server, seed.home, seed=7, target_batch_size=APP_SWARM_BATCH))
    state = seed.wait_for(lambda e: getattr(e, "state", None) == "training", 120)
    assert state is not None, "the seed peer did not start"
    monkeypatch.setenv("DEDLOC_INITIAL_PEERS", " ".join(state.maddrs))
    write_prefs(home, consent=True, idle_minutes=0.5, other_cpu_limit=None)
    with xvfb() as display:
        monkeypatch.setenv("DISPLAY", display)
        app = make_app()
        try:
            _run_away_and_return(app, qtbot, display)
        finally:  # quit while the X server still runs: Xlib ends a process whose display vanishes
            done = []
            app.controller.quit(lambda: done.append(True))
            qtbot.waitUntil(lambda: bool(done), timeout=60000)
            app.controller.contributor.sampler.idle.close()


def _run_away_and_return(app, qtbot, display: str) -> None:
    from desktop import xdotool

    qtbot.waitUntil(lambda: (app.controller.idle_source or "").startswith("X11"), timeout=15000)
    qtbot.waitUntil(lambda: "X11" in app.window.show_page("This computer").label.text(), timeout=15000)
    xdotool(display, "mousemove", "10", "10")
    assert app.controller.join("tiny-lm-test")
    qtbot.waitUntil(lambda: app.controller.status.text == "Paused: you are using the computer", timeout=5000)
    assert app.supervisor.worker is None, "a worker started while the user was present"
    # The policy paused, not the user: the tray offers Pause, and Resume would undo nothing.
    assert app.tray.pause_action.isVisible() and not app.tray.resume_action.isVisible()

    qtbot.waitUntil(lambda: app.controller.status.state == "training" and app.controller.last_progress is not None,
                    timeout=240000)
    # The pause comes from the input event itself (XInput 2), not from the next poll: with the
    # app's periodic tick stopped, only the idle source's watcher can bring it.
    assert "input events" in app.controller.idle_source
    app.controller._tick.stop()
    qtbot.wait(300)  # (the last periodic tick armed the watcher)
    returned = time.monotonic()
    xdotool(display, "mousemove_relative", "--", "30", "20")  # device motion, as a mouse makes
    qtbot.waitUntil(lambda: app.controller.worker_state.state == "paused", timeout=5000)
    took = time.monotonic() - returned
    app.controller._tick.start()
    assert app.controller.status.text == "Paused: you are using the computer"
    assert took < 2.0, f"the worker paused {took:.2f} s after the user came back"


@pytest.mark.timeout(400)
def test_diloco_mode_and_the_next_sync_are_shown(make_app, qtbot, tmp_path, corpus_server, monkeypatch):
    """A real worker alone in a DiLoCo experiment: the tray says the mode and the time to the next
    sync, the Experiments page the mode and the outer round."""
    from conftest import serve_signed_catalog, tiny_experiment

    exp = tiny_experiment(id="tiny-diloco", title="Tiny DiLoCo", run_id="tiny_diloco_app", mode="diloco",
                          diloco={"inner_steps": 20, "outer_lr": 0.7, "outer_momentum": 0.9, "compression": "fp16"})
    serve_signed_catalog(corpus_server, tmp_path, monkeypatch, [exp])
    app = make_app()
    page = app.window.show_page("Experiments")
    assert app.controller.join("tiny-diloco")
    qtbot.waitUntil(lambda: "DiLoCo, next sync in" in app.controller.status.text, timeout=240000)
    assert "Mode:</b> DiLoCo (syncs every 20 local steps, fp16 deltas)" in page.details.text()
    qtbot.waitUntil(lambda: "outer round" in page.details.text(), timeout=10000)


def _progress(n: int) -> Progress:
    return Progress(local_epoch=n, global_step=n, samples_per_second=1.0, swarm_samples_per_second=1.0, loss=None,
                    num_peers=1, samples_accumulated=0, target_batch_size=1, bytes_sent=0, bytes_received=0)


def test_a_flood_of_worker_events_does_not_pile_up_for_the_gui(qtbot, home):
    """Progress and Stats are superseded by the next: the supervisor hands the GUI the latest, keeps
    the order of other events, and never lets the bridge's queue grow with the worker's rate."""
    import threading

    from PySide6.QtWidgets import QApplication

    from app.bridge import Bridge
    from app.supervisor import Supervisor

    bridge = Bridge(QApplication.instance())
    sup = Supervisor(bridge, pid_file=home / "data" / "worker.pid")
    got: list[object] = []
    for signal in (sup.progress, sup.stats, sup.state):
        signal.connect(got.append)
    gen = sup._generation

    def flood():
        for n in range(20000):
            sup._from_worker(gen, _progress(n))
            sup._from_worker(gen, Stats(samples=n, compute_seconds=0, rounds=0, bytes_sent=0, bytes_received=0,
                                        paused_seconds=0, averaging_seconds=0, device="cpu"))

    reader = threading.Thread(target=flood)  # the worker's reader thread, as in the app
    reader.start()
    reader.join()
    assert bridge._calls.qsize() <= 1, bridge._calls.qsize()  # 40,000 events, at most one call queued
    qtbot.waitUntil(lambda: bool(got) and isinstance(got[-1], Stats) and got[-1].samples == 19999, timeout=5000)
    assert len(got) < 100

    got.clear()
    sup._from_worker(gen, _progress(1))
    sup._from_worker(gen, State(state="paused", reason="by you"))
    sup._from_worker(gen, _progress(2))
    qtbot.waitUntil(lambda: len(got) == 3, timeout=5000)
    assert [type(e).__name__ for e in got] == ["Progress", "State", "Progress"]
    assert got[0].local_epoch == 1 and got[2].local_epoch == 2
    bridge.shutdown()


def test_the_event_log_page_keeps_the_last_entries_only(make_app):
    from app.controller import MAX_LOG

    app = make_app()
    page = app.window.show_page("Event log")
    page.filter.setCurrentIndex(0)  # everything
    for n in range(MAX_LOG + 300):
        app.controller.note("INFO", f"entry {n}")
    assert page.tree.topLevelItemCount() == MAX_LOG and len(app.controller.log_entries) == MAX_LOG
    assert page.visible_messages()[-1] == f"entry {MAX_LOG + 299}"


def test_add_experiments_from_a_link_then_remove_the_source(make_app, qtbot, tmp_path):
    """The organizer's link opens the dialog; the organizer and fingerprint are shown before trusting;
    the experiments appear with where they come from; the source can be removed."""
    from conftest import Organizer

    from dedloc_core.catalog import sources
    from dedloc_core.organizer.httpserve import FileServer

    with FileServer() as server:
        org = Organizer(server)
        app = make_app()
        page = app.window.show_page("Experiments")
        dialog = page.open_add_dialog(sources.add_link(org.url, org.key_b64))
        qtbot.waitUntil(dialog.trust_button.isEnabled, timeout=60000)
        assert org.name in dialog.info.text() and sources.fingerprint(org.key_b64) in dialog.info.text()
        dialog.trust_button.click()
        qtbot.waitUntil(lambda: app.controller.experiment("org-exp") is not None, timeout=60000)
        texts = [page.list.item(i).text() for i in range(page.list.count())]
        assert any("Organizer's experiment" in t and f"from {org.name}" in t for t in texts), texts

        listing = page.open_sources()
        rows = [listing.list.item(i).text() for i in range(listing.list.count())]
        assert len(rows) == 2 and org.url in rows[1]
        listing.list.setCurrentRow(0)
        assert not listing.remove_button.isEnabled()  # the built-in source stays
        listing.list.setCurrentRow(1)
        listing.remove_button.click()
        qtbot.waitUntil(lambda: app.controller.experiment("org-exp") is None, timeout=60000)


def test_the_tray_tells_when_the_joined_experiment_ends_and_when_the_worker_keeps_failing(make_app, qtbot):
    from conftest import Organizer

    from app.controller import CRASH_NOTIFY_AFTER
    from dedloc_core.organizer.httpserve import FileServer

    with FileServer() as server:
        org = Organizer(server)
        app = make_app()
        app.controller.add_source(org.url, org.key_b64, org.name)
        qtbot.waitUntil(lambda: app.controller.experiment("org-exp") is not None, timeout=60000)
        assert app.controller.join("org-exp")  # idle-only and the user "present": no worker starts
        org.publish(org.key, status="finished")
        app.controller.refresh_catalog()
        qtbot.waitUntil(lambda: app.controller.joined is None, timeout=60000)
        assert app.tray.last_message[0] == "Organizer's experiment has ended"
        assert app.controller.prefs.experiment_id is None

    app.supervisor.backoff = (30.0,)
    for _ in range(CRASH_NOTIFY_AFTER):
        app.supervisor._failed("The worker stopped unexpectedly (exit code 1).")
    assert app.tray.last_message[0] == "Training keeps stopping" and "3 times" in app.tray.last_message[1]
    app.supervisor._restart.stop()


def test_the_window_in_its_own_process_mirrors_the_tray_and_sends_commands(qtbot, home):
    """The window's side (``app.remote``) against a real tray app over its real single-instance socket
    (both in this process, to reach their widgets): the window shows the tray's state and follows
    it; Join, Leave and Save in the window are carried out by the tray's controller."""
    from PySide6.QtWidgets import QApplication

    from app.instance import SingleInstance
    from app.main import build
    from app.remote import connect, open_window, when_ready

    app = build(QApplication.instance(), tray=True, window_process=True)
    app.controller.start()
    app.controller.pause()  # no worker starts on Join: this test is about the window
    qtbot.waitUntil(lambda: app.controller.catalog is not None and app.controller.hardware is not None,
                    timeout=15000)
    name = f"dedloc-test-{os.getpid()}-{time.monotonic_ns()}"
    instance = SingleInstance(name)
    assert instance.listen(app.show_window, app.open_link, app.host.attach)
    try:
        channel, opened = connect(name), []
        assert channel is not None
        closed: list[bool] = []
        when_ready(channel, lambda state: opened.append(open_window(channel, state, lambda: closed.append(True))))
        qtbot.waitUntil(lambda: bool(opened), timeout=10000)
        window, remote = opened[0]
        qtbot.waitUntil(lambda: window.isVisible(), timeout=5000)  # the tray's "show" came with the state
        page = window.pages["Experiments"]
        assert page.list.count() == len(app.controller.catalog.catalog.experiments) > 0
        assert remote.status == app.controller.status and remote.hardware == app.controller.hardware
        assert remote.idle_source_text() == app.controller.idle_source_text()

        # Join in the window: the tray joins, and the window follows its state.
        exp = next(e for e in app.controller.catalog.catalog.experiments if e.status == "active")
        page.list.setCurrentRow(next(i for i in range(page.list.count()) if page.list.item(i).data(256) == exp.id))
        page.join_selected()
        qtbot.waitUntil(lambda: app.controller.joined is not None and remote.joined is not None, timeout=5000)
        assert remote.joined.id == exp.id == app.controller.joined.id
        qtbot.waitUntil(lambda: remote.status == app.controller.status, timeout=5000)
        assert "Joined" in page.details.text() and app.supervisor.worker is None

        # Preferences saved in the window are the tray's (and its file's).
        form = window.pages["Contribution"]
        form.widgets["upload_cap_kbs"].setValue(321)
        assert form.save()
        qtbot.waitUntil(lambda: app.controller.prefs.upload_cap_kbs == 321, timeout=5000)
        qtbot.waitUntil(lambda: '"upload_cap_kbs": 321' in (home / "config" / "preferences.json").read_text()
                        .replace('"upload_cap_kbs":321', '"upload_cap_kbs": 321'), timeout=5000)

        # The tray's log reaches the window's Event log; Leave goes back to the tray.
        app.controller.note("WARNING", "a note from the tray")
        log = window.pages["Event log"]
        qtbot.waitUntil(lambda: "a note from the tray" in log.visible_messages(), timeout=5000)
        page.leave_button.click()
        qtbot.waitUntil(lambda: app.controller.joined is None and remote.joined is None, timeout=5000)

        # Where the worker runs: set in the window, shown on its "This computer" page.
        form.widgets["worker_command"].setText("ssh rig dedloc worker")
        assert form.save()
        qtbot.waitUntil(lambda: remote.worker_place() == "through ssh rig dedloc worker", timeout=5000)
        assert app.supervisor.command == ["ssh", "rig", "dedloc", "worker"]
        assert "through ssh rig dedloc worker" in window.pages["This computer"].label.text()

        # A second launch with a page shows that page; a malformed command is dropped, not fatal.
        SingleInstance(name).notify_running(page="Statistics")
        qtbot.waitUntil(lambda: window.stack.currentWidget() is window.pages["Statistics"], timeout=5000)
        remote.channel.send("save_prefs", prefs={"idle_minutes": "soon"})
        remote.channel.send("join")
        remote.channel.socket.write(b"not json\n")
        qtbot.wait(300)
        assert app.controller.prefs.upload_cap_kbs == 321 and app.controller.joined is None

        # Closing the window ends it (its process exits); so does the tray quitting.
        window.close()
        assert closed == [True]
        app.host.close(timeout_ms=100)
        qtbot.waitUntil(lambda: len(closed) == 2, timeout=5000)
        window.hide()
        remote.bridge.shutdown()
    finally:
        instance.close()
    done = []
    app.controller.quit(lambda: done.append(True))
    qtbot.waitUntil(lambda: bool(done), timeout=60000)
    app.bridge.shutdown()
    app.tray.hide()


def test_a_declared_model_shows_its_size_and_the_gpu_it_needs(make_app, qtbot, tmp_path, corpus_server, monkeypatch):
    """sahajBERT's ALBERT-large, 4 x 512 tokens a micro-batch: the page says what the model needs
    (declared.fit), and that this GPU-less computer lacks it, though the organizer asked for no GPU."""
    from conftest import serve_signed_catalog, tiny_experiment

    config = dict(vocab_size=32000, embedding_size=128, hidden_size=1024, num_hidden_layers=24,
                  num_attention_heads=16, intermediate_size=4096, max_position_embeddings=512)
    exp = tiny_experiment(id="sahajbert", title="sahajBERT", run_id="sahajbert", recipe="masked-lm",
                          recipe_params={"family": "albert", "seq_len": 512, "config": config},
                          batch_size_per_step=4, target_batch_size=4096)
    serve_signed_catalog(corpus_server, tmp_path, monkeypatch, [exp])
    app = make_app()
    page = app.window.show_page("Experiments")
    page.list.setCurrentRow(0)
    qtbot.waitUntil(lambda: "sahajBERT" in page.details.text(), timeout=10000)
    text = page.details.text()
    assert "Albert: 17.1 M parameters" in text and "needs a GPU with 10 GB" in text, text
    assert "an NVIDIA GPU with 10 GB" in text and "lacks" in text, text
