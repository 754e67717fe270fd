"""Screenshots of the real app on a real X server (Xvfb + openbox + trayer as the tray host), while
it trains with a real worker: the first-run dialog, every page and the tray menu, saved under
artifacts/screens/ (CI keeps that folder)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from desktop import need, xvfb

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCREENS = ROOT / "artifacts" / "screens"
PAGES = ["experiments", "contribution", "statistics", "this-computer", "event-log"]


def colors(path: Path) -> int:
    """How many distinct colours a PNG has (a blank or black grab has one or two)."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtGui import QImage

    image = QImage(str(path))
    assert not image.isNull(), path
    seen = set()
    for y in range(0, image.height(), 4):
        for x in range(0, image.width(), 4):
            seen.add(image.pixel(x, y))
    return len(seen)


@pytest.mark.timeout(600)
def test_screenshots_of_every_page_and_the_tray_menu(tmp_path, signed_catalog_server, spawn_worker):
    need("Xvfb", "xdpyinfo", "openbox", "trayer", "xdotool")
    from conftest import APP_SWARM_BATCH, start_command

    seed = spawn_worker("seed")
    seed.send(start_command(signed_catalog_server, seed.home, seed=7, target_batch_size=APP_SWARM_BATCH))
    state = seed.wait_for(lambda e: getattr(e, "state", None) == "training", 120)
    assert state is not None, "the seed peer did not start"
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    (home / "config" / "preferences.json").write_text(  # contribute while "in use": Xvfb just started
        json.dumps({"version": 1, "consent": True, "idle_only": False, "other_cpu_limit": None}))
    with xvfb(tray=True) as display:
        env = {**os.environ, "DISPLAY": display, "DEDLOC_HOME": str(home), "DEDLOC_LISTEN": "/ip4/127.0.0.1/tcp/0",
               "DEDLOC_INITIAL_PEERS": " ".join(state.maddrs)}
        run = subprocess.run([sys.executable, str(ROOT / "tests" / "screens_app.py"), str(SCREENS), "tiny-lm-test"],
                             env=env, capture_output=True, text=True, timeout=500)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["tray"], "the tray host was not seen"
    assert seen["status"].startswith("Training tiny-lm"), seen["status"]
    assert any(text.startswith("Training tiny-lm") for text in seen["menu"]) and "Pause" in seen["menu"]
    expected = ["first-run", *(f"page-{p}" for p in PAGES), "tray-menu"]
    assert seen["saved"] == [f"{name}.png" for name in expected]
    for name in expected:
        path = SCREENS / f"{name}.png"
        assert path.stat().st_size > 5000, path
        assert colors(path) > 20, f"{path} looks blank"
