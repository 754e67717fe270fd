"""Resident memory of the tray app's GUI process (target: under 100 MB while it sits in the tray).

Starts a real desktop (Xvfb, openbox, trayer as the tray host), then `dedloc app --hidden` with a
fresh home whose preferences say consent was given and no experiment is joined, so the app starts
straight into the tray. It measures the GUI process (its own RSS and PSS, not the worker's):

1. in the tray, 20 s after start;
2. with the window open on each page in turn (Experiments, Contribution, Statistics, Computer, Event log);
3. back in the tray, 20 s after the window was closed.

    .venv/bin/python bench/app_memory.py

Needs: xvfb openbox trayer xdotool x11-utils (apt).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.desktop import xvfb  # noqa: E402


def mem(proc: psutil.Process) -> tuple[float, float]:
    info = proc.memory_full_info()
    return info.rss / 2**20, info.pss / 2**20


def window_id(env: dict[str, str], title: str = "DeDLOC Volunteer") -> str | None:
    out = subprocess.run(["xdotool", "search", "--onlyvisible", "--name", title],
                         env=env, capture_output=True, text=True)
    ids = out.stdout.split()
    return ids[0] if ids else None


def main() -> int:
    for tool in ("Xvfb", "openbox", "trayer", "xdotool"):
        if shutil.which(tool) is None:
            print(f"needs {tool} (apt-get install xvfb openbox trayer xdotool x11-utils)")
            return 2
    home = Path(tempfile.mkdtemp(prefix="dedloc-mem-"))
    (home / "config").mkdir(parents=True)
    (home / "config" / "preferences.json").write_text(json.dumps({"version": 1, "consent": True}))
    rows: list[tuple[str, float, float]] = []
    with xvfb(tray=True) as display:
        env = dict(os.environ, DISPLAY=display, DEDLOC_HOME=str(home), QT_QPA_PLATFORM="xcb")
        app = subprocess.Popen([sys.executable, "-m", "dedloc_core.cli", "app", "--hidden"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            proc = psutil.Process(app.pid)
            time.sleep(20)
            assert app.poll() is None, "the app exited"
            assert window_id(env) is None, "the window opened: no tray host?"
            rows.append(("in the tray, 20 s after start", *mem(proc)))
            # A second start asks the running one to show its window (single instance).
            subprocess.run([sys.executable, "-m", "dedloc_core.cli", "app"], env=env, timeout=60,
                           stdout=subprocess.DEVNULL)
            deadline = time.time() + 15
            while window_id(env) is None and time.time() < deadline:
                time.sleep(0.3)
            wid = window_id(env)
            assert wid, "the window did not open"
            time.sleep(3)
            rows.append(("window open (first page)", *mem(proc)))
            for page in range(1, 5):  # the page list has keyboard focus: Down moves to the next page
                subprocess.run(["xdotool", "windowactivate", "--sync", wid, "key", "Down"], env=env)
                time.sleep(3)
                rows.append((f"window open, page {page + 1}", *mem(proc)))
            subprocess.run(["xdotool", "windowclose", wid], env=env)
            time.sleep(20)
            assert app.poll() is None, "closing the window quit the app"
            rows.append(("back in the tray, 20 s later", *mem(proc)))
        finally:
            app.terminate()
            try:
                app.wait(30)
            except subprocess.TimeoutExpired:
                app.kill()
            shutil.rmtree(home, ignore_errors=True)
    print(f"{'stage':<34} {'RSS MB':>8} {'PSS MB':>8}")
    for name, rss, pss in rows:
        print(f"{name:<34} {rss:8.1f} {pss:8.1f}")
    print(f"tray RSS MB: {rows[0][1]:.1f}, after window RSS MB: {rows[-1][1]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
