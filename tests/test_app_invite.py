"""The app on an invite-only experiment, with real parts: a backbone issuing tokens (6 s lifetime),
the real app under Xvfb with a tray host, a real Secret Service in a private D-Bus session. Join asks
for the invite code, the code lands in the keyring, the worker redeems it and trains; once the
organizer revokes it, the app leaves the experiment, says why on the Experiments page and notifies.
Screenshots go to artifacts/screens/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_experiment
from desktop import need, xvfb
from swarmpeer import start_backbone
from test_invite_worker import free_port, secret_service  # noqa: F401 - the fixture

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCREENS = ROOT / "artifacts" / "screens"


@pytest.mark.timeout(900)
def test_join_asks_for_the_code_keeps_it_in_the_keyring_and_shows_a_revoked_invite(
        secret_service, tmp_path, monkeypatch):  # noqa: F811
    need("Xvfb", "xdpyinfo", "openbox", "trayer", "xdotool")
    from dedloc_core.organizer import invites as org

    monkeypatch.setenv("DEDLOC_INVITE_PASSPHRASE", "pw")
    key = org.generate_key(tmp_path / "backbone", "pw")
    port = free_port()
    exp = tiny_experiment(id="gated-app", title="Gated experiment", organizer="Gate Lab", run_id="gated_app",
                          needs_token=True, invite_key=key, invite_url=f"http://127.0.0.1:{port}/",
                          target_batch_size=128)
    code, _ = org.InviteStore(tmp_path / "backbone").create(uses=1, note="app test")
    backbone, ready, _ = start_backbone(exp, tmp_path, http=True,
                                        extra=("--http-port", str(port), "--token-lifetime", "6"))
    try:
        home = tmp_path / "home"
        (home / "config").mkdir(parents=True)
        (home / "config" / "preferences.json").write_text(json.dumps(
            {"version": 1, "consent": True, "idle_only": False, "other_cpu_limit": None}))
        with xvfb(tray=True) as display:
            env = {**os.environ, "DISPLAY": display, "DEDLOC_HOME": str(home),
                   "DEDLOC_CATALOG_URL": f"{ready['http_url']}catalog.json",
                   "DEDLOC_TRUSTED_KEYS": str(tmp_path / "catalog"), "DEDLOC_LISTEN": "/ip4/127.0.0.1/tcp/0",
                   "DEDLOC_INITIAL_PEERS": " ".join(ready["maddrs"])}
            run = subprocess.run([sys.executable, str(ROOT / "tests" / "invite_app.py"), str(SCREENS), exp["id"],
                                  code, str(tmp_path / "backbone")], env=env, capture_output=True, text=True,
                                 timeout=700)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        seen = json.loads(run.stdout.strip().splitlines()[-1])
        assert "invite-only" in seen["label"] and "Gate Lab" in seen["label"], seen["label"]
        assert seen["stored"] == code  # in the Secret Service, not in a file
        assert code not in (home / "config" / "preferences.json").read_text()
        assert seen["joined"] is None and seen["prefs_joined"] is None  # it left: retrying cannot help
        assert "Your invite no longer works" in seen["details"] and "revoked" in seen["details"].lower()
        assert any("Invite" in title and "revoked" in (title + message).lower() for title, message in seen["notes"])
        for name in seen["saved"]:
            assert (SCREENS / name).stat().st_size > 5000
    finally:
        backbone.stop(60)
