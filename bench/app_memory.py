"""Resident memory of the tray app's GUI process (target: under 100 MB while it sits in the tray).

Starts a real desktop (Xvfb, openbox, trayer as the tray host), then `dedloc app --hidden` with a
fresh home whose preferences say consent was given and no experiment is joined, so the app starts
straight into the tray. It measures the tray's GUI process and, while it is open, the window's own
process (``dedloc app --window``), RSS and PSS (not the worker's):

1. in the tray, 20 s after start;
2. with the window open on each page in turn (a second launch asks for the page: ``show PAGE``);
3. back in the tray, 20 s after the window was closed (Alt+F4, as a person would).

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

from tests.desktop import stop, xvfb  # noqa: E402

PAGES = ["Experiments", "Contribution", "Statistics", "This computer", "Event log"]


def mem(proc: psutil.Process | None) -> tuple[float, float]:
    if proc is None:
        return 0.0, 0.0
    info = proc.memory_full_info()
    return info.rss / 2**20, info.pss / 2**20


def window_id(env: dict[str, str], title: str = "DeDLOC Volunteer") -> str | None:
    out = subprocess.run(["xdotool", "search", "--onlyvisible", "--name", title],
                         env=env, capture_output=True, text=True)
    ids = out.stdout.split()
    return ids[0] if ids else None


def window_process(tray: psutil.Process) -> psutil.Process | None:
    return next((c for c in tray.children() if "--window" in c.cmdline()), None)


def main() -> int:
    for tool in ("Xvfb", "openbox", "trayer", "xdotool"):
        if shutil.which(tool) is None:
            print(f"needs {tool} (apt-get install xvfb openbox trayer xdotool x11-utils)")
            return 2
    home = Path(tempfile.mkdtemp(prefix="dedloc-mem-"))
    (home / "config").mkdir(parents=True)
    (home / "config" / "preferences.json").write_text(json.dumps({"version": 1, "consent": True}))
    rows: list[tuple[str, float, float, float, float]] = []

    def row(name: str) -> None:
        rows.append((name, *mem(tray), *mem(window_process(tray))))

    with xvfb(tray=True) as display:
        env = dict(os.environ, DISPLAY=display, DEDLOC_HOME=str(home), QT_QPA_PLATFORM="xcb")
        app = subprocess.Popen([sys.executable, "-m", "dedloc_core.cli", "app", "--hidden"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            tray = psutil.Process(app.pid)
            time.sleep(20)
            assert app.poll() is None, "the app exited"
            assert window_id(env) is None, "the window opened: no tray host?"
            row("in the tray, 20 s after start")
            for page in PAGES:  # a second launch asks the running app to show its window at a page
                show = f"from app.instance import SingleInstance; SingleInstance().notify_running(5000, page={page!r})"
                subprocess.run([sys.executable, "-c", show], env=env, timeout=60)
                deadline = time.time() + 30
                while window_id(env) is None and time.time() < deadline:
                    time.sleep(0.3)
                assert window_id(env), "the window did not open"
                time.sleep(3)
                row(f"window open: {page}")
            wid = window_id(env)
            subprocess.run(["xdotool", "windowactivate", "--sync", wid, "key", "alt+F4"], env=env)
            time.sleep(20)
            assert app.poll() is None, "closing the window quit the app"
            row("back in the tray, 20 s later")
        finally:
            stop(app, 30)
            shutil.rmtree(home, ignore_errors=True)
    print(f"{'stage':<34} {'tray RSS':>9} {'tray PSS':>9} {'window RSS':>11} {'window PSS':>11}  (MB)")
    for name, rss, pss, wrss, wpss in rows:
        print(f"{name:<34} {rss:9.1f} {pss:9.1f} {wrss:11.1f} {wpss:11.1f}")
    print(f"tray RSS MB: {rows[0][1]:.1f}, most with the window open: {max(r[1] for r in rows):.1f}, "
          f"after the window: {rows[-1][1]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
