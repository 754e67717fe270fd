"""From an organizer's page to a volunteer's Join, with real parts: a real backbone on loopback serves a
catalog signed by the organizer's key, its dashboard and its key; the real app (under Xvfb, with a
tray host) opens the organizer's dedloc://add link, shows who signs the catalog, trusts it, joins and
trains; the dashboard, in headless Chromium, then lists this volunteer on its leaderboard.
Screenshots go to artifacts/screens/."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import tiny_experiment
from desktop import need, xvfb
from swarmpeer import start_backbone

from dedloc_core.catalog import sources

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCREENS = ROOT / "artifacts" / "screens"
NAME = "Flow Volunteer"


def chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(900)
def test_a_volunteer_joins_from_the_organizers_link_and_shows_on_the_dashboard(tmp_path):
    need("Xvfb", "xdpyinfo", "openbox", "trayer", "xdotool")
    exp = tiny_experiment(id="flow-exp", title="Flow experiment", organizer="Flow Lab", run_id="flow_exp",
                          target_batch_size=256)
    backbone, ready, key_b64 = start_backbone(exp, tmp_path, http=True)
    try:
        http = ready["http_url"]
        with urllib.request.urlopen(f"{http}catalog.pub", timeout=10) as response:  # the key the page links
            assert response.read().decode().split()[1] == key_b64
        link = sources.add_link(f"{http}catalog.json", key_b64)
        home = tmp_path / "home"
        (home / "config").mkdir(parents=True)
        (home / "config" / "preferences.json").write_text(json.dumps(
            {"version": 1, "consent": True, "idle_only": False, "other_cpu_limit": None, "display_name": NAME}))
        with xvfb(tray=True) as display:
            env = {**os.environ, "DISPLAY": display, "DEDLOC_HOME": str(home), "DEDLOC_LISTEN": "/ip4/127.0.0.1/tcp/0",
                   "DEDLOC_INITIAL_PEERS": " ".join(ready["maddrs"])}
            env.pop("DEDLOC_CATALOG_URL", None)
            run = subprocess.run([sys.executable, str(ROOT / "tests" / "organizer_app.py"), str(SCREENS), link,
                                  exp["id"]], env=env, capture_output=True, text=True, timeout=700)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        seen = json.loads(run.stdout.strip().splitlines()[-1])
        assert "Flow Lab" in seen["dialog"] and sources.fingerprint(key_b64) in seen["dialog"]
        assert any("Flow experiment" in item and "from Flow Lab" in item for item in seen["items"]), seen["items"]
        assert "Your rank:</b> 1 of 1" in seen["details"], seen["details"]
        for name in seen["saved"]:
            assert (SCREENS / name).stat().st_size > 5000

        if shutil.which("chromium") is None:
            pytest.skip("chromium is not installed (apt-get install chromium): the dashboard was not checked")
        dom = chromium("--virtual-time-budget=8000", "--dump-dom", http).stdout
        assert NAME in dom and "Flow experiment" in dom, dom[-2000:]
        assert "dedloc://add?url=" in dom
        chromium("--window-size=1280,1400", f"--screenshot={SCREENS / 'dashboard.png'}", "--virtual-time-budget=8000",
                 http)
        assert (SCREENS / "dashboard.png").stat().st_size > 5000
    finally:
        backbone.stop(60)
