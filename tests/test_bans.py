"""Bans that hold (``engine/bans.py``, ``engine/robust.py``, ``hivemind_ext.robust_reduce``): one ban
list per worker, shared by its averager processes (a real swarm on loopback, in a probe); kept in
the data dir across restarts until it expires (real files, new processes); a broken file is a
warning; in an invite-only experiment each ban is reported to the backbone's real HTTP side,
members only, and ``dedloc invite reports`` lists it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from contextlib import ExitStack

import msgspec
import pytest
from conftest import tiny_experiment
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from probes import ROOT, probe_json

from dedloc_core import invites
from dedloc_core.catalog import Experiment, public_key_line
from dedloc_core.engine import bans
from dedloc_core.invites import InviteError
from dedloc_core.organizer import backbone as backbone_mod
from dedloc_core.organizer import invites as org

RUN = "ban_test_run"
MALLORY = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # any base58 peer id
EVE = "QmT5NvUtoM5nWFfrQdVrFtvGfKFmG7AHE8P34isapyhCxX"


@pytest.fixture
def home(tmp_path):
    yield tmp_path
    bans.close()  # pytest's process: later tests start with no ban file


def in_new_process(home, code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "DEDLOC_HOME": str(home)})
    assert out.returncode == 0, out.stderr[-3000:]
    return {"out": json.loads(out.stdout.strip().splitlines()[-1]), "log": out.stderr}


BAN = f"""
import json
from dedloc_core.engine import bans, robust
bans.load({RUN!r})
robust.ban({MALLORY!r}, "returned a wrong average", seconds=600)
robust.ban({EVE!r}, "failed a check", seconds=5)
peer = "QmRepeatOffenderRepeatOffenderRepeatOffender12"
hits = [robust.strike(peer, "sent NaN or inf") for _ in range(robust.STRIKES)]
print(json.dumps(hits))
"""

LOAD = f"""
import json
from dedloc_core.engine import bans
loaded = bans.load({RUN!r})
print(json.dumps({{"loaded": sorted([b.peer, b.reason] for b in loaded),
                  "mallory": bans.banned({MALLORY!r}), "eve": bans.banned({EVE!r})}}))
"""


def test_a_ban_survives_a_restart_and_expires_after_its_period(home):
    assert in_new_process(home, BAN)["out"] == [False, False, True]  # the third strike bans
    path = bans.file_for(RUN, home / "data" / "bans")
    assert path.is_file(), list(home.rglob("*"))
    restarted = in_new_process(home, LOAD)["out"]  # a new worker process reads the file
    assert restarted["mallory"] and restarted["eve"], restarted
    assert restarted["loaded"] == [["QmRepeatOffenderRepeatOffenderRepeatOffender12", "sent NaN or inf (3 times)"],
                                   [EVE, "failed a check"], [MALLORY, "returned a wrong average"]], restarted
    until = {b["peer"]: b["until"] for b in json.loads(path.read_text())["bans"]}
    assert until[MALLORY] - until[EVE] == pytest.approx(595, abs=5)
    time.sleep(max(0.0, until[EVE] + 0.2 - time.time()))  # eve's 5 s are over, mallory's 600 s are not
    later = in_new_process(home, LOAD)["out"]
    assert later["mallory"] and not later["eve"], later
    assert [peer for peer, _ in later["loaded"]] == ["QmRepeatOffenderRepeatOffenderRepeatOffender12", MALLORY]


@pytest.mark.parametrize("content", [b"\x00\xff\xfe garbage", b'{"format": 1, "bans": [', b"[]",
                                     b'{"format": 1, "bans": [{"peer": "QmX", "reason": "r"}]}',
                                     b'{"format": 1, "bans": [{"peer": "QmX", "reason": "r", "since": NaN, '
                                     b'"until": 1e300}]}', b'{"format": 99, "bans": []}', None])
def test_a_broken_ban_file_is_a_warning_and_no_bans(home, caplog, content):
    path = bans.file_for(RUN, home)
    if content is None:
        path.mkdir(parents=True)  # unreadable: a folder where the file should be
    else:
        path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger=bans.__name__):
        assert bans.load(RUN, home) == []
    assert any("ban list" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records), caplog.text
    assert bans.active() == [] and not bans.banned("QmX")
    if content is not None:  # the next ban replaces the broken file with a good one
        assert bans.ban(MALLORY, "test", 60)
        assert [b.peer for b in bans.load(RUN, home)] == [MALLORY]


# ------------------------------------------------------------------------ reported to the backbone
def identity():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def peer_of(key) -> str:
    return invites.peer_id_of_der(invites.public_der(key))


@pytest.fixture
def backbone(tmp_path):
    """A backbone's HTTP side with its own routes (``Backbone._serve_http``) for an invite-only
    experiment: (issuer, url, run dir)."""
    run_dir = tmp_path / "backbone"
    run_dir.mkdir()
    key = org.generate_key(run_dir, "pw")
    issuer = org.Issuer(org.InviteStore(run_dir), org.load_key(run_dir, "pw"), RUN, lifetime=60.0)
    node = backbone_mod.Backbone(backbone_mod.parse_args(["--run-dir", str(run_dir), "--http-port", "0"]))
    node.issuer = issuer
    node.view = backbone_mod.SwarmView.load(run_dir, RUN)
    exp = msgspec.convert(tiny_experiment(run_id=RUN, needs_token=True, invite_key=key,
                                          invite_url="http://127.0.0.1/"), Experiment)
    with ExitStack() as stack:
        key_line = public_key_line(Ed25519PrivateKey.generate().public_key())
        url = node._serve_http(stack, b"{}", exp, key_line)
        yield issuer, url, run_dir


def wait_for(condition, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def dedloc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dedloc_core.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_a_ban_is_reported_once_to_the_backbone_and_listed_for_the_organizer(backbone, home, caplog):
    issuer, url, run_dir = backbone
    code, _ = issuer.store.create(uses=2)
    alice = identity()
    invites.redeem(url, code, alice, RUN)
    bans.load(RUN, home)
    reporter = bans.Reporter(url, alice, RUN, poll=0.05)
    try:
        assert bans.ban(MALLORY, "returned a wrong average", 600)
        wait_for(lambda: len(issuer.store.reports()) == 1)
        assert bans.ban(MALLORY, "returned a wrong average", 1200)  # longer: the same ban, not reported again
        assert bans.ban(EVE, "sent NaN or inf (3 times)", 600)
        wait_for(lambda: len(issuer.store.reports()) == 2)
        time.sleep(0.3)
    finally:
        reporter.stop()
    reports = issuer.store.reports()
    assert [(r.reporter, r.reported, r.reason) for r in reports] == [
        (peer_of(alice), MALLORY, "returned a wrong average"), (peer_of(alice), EVE, "sent NaN or inf (3 times)")]
    assert reporter.reported == {MALLORY: True, EVE: True}

    listed = dedloc("invite", "reports", "--run-dir", str(run_dir))
    assert listed.returncode == 0, listed.stderr
    assert MALLORY in listed.stdout and "returned a wrong average" in listed.stdout and "not a member" in listed.stdout
    assert "dedloc invite revoke" in listed.stdout
    as_json = json.loads(dedloc("invite", "reports", "--run-dir", str(run_dir), "--json").stdout)
    assert {p["peer_id"]: p["reporters"] for p in as_json["peers"]} == {MALLORY: [peer_of(alice)],
                                                                        EVE: [peer_of(alice)]}

    # a backbone that cannot be reached: a log line, the worker carries on
    down = bans.Reporter("http://127.0.0.1:9/", alice, RUN, poll=0.05)
    try:
        with caplog.at_level(logging.WARNING, logger=bans.__name__):
            assert bans.ban("QmZMxNdpMkewiVZLMRxaNxUeZpDUb34pWjZ1kZvsd16Zic", "failed a check", 600)
            wait_for(lambda: down.reported)
    finally:
        down.stop()
    assert down.reported == {"QmZMxNdpMkewiVZLMRxaNxUeZpDUb34pWjZ1kZvsd16Zic": False}
    assert "Could not report banned peer" in caplog.text


def test_only_members_may_report_and_each_only_so_often(backbone, monkeypatch):
    issuer, url, _ = backbone
    code, _ = issuer.store.create(uses=5)
    alice, bob, mallory = identity(), identity(), identity()
    with pytest.raises(InviteError) as stranger:  # never redeemed a code
        invites.report(url, mallory, RUN, peer_of(alice), "slander")
    assert stranger.value.code == "invite_unknown"
    invites.redeem(url, code, alice, RUN)
    invites.redeem(url, code, bob, RUN)
    assert invites.report(url, alice, RUN, MALLORY, "returned a wrong average") == 1
    assert invites.report(url, bob, RUN, MALLORY, "sent NaN or inf (3 times)") == 2  # two members now
    issuer.store.revoke(peer_of(bob))
    with pytest.raises(InviteError) as revoked:
        invites.report(url, bob, RUN, EVE, "slander")
    assert revoked.value.code == "invite_revoked"
    forged = invites._signed("report", mallory, RUN, f"{EVE}\nx") | {"peer_id": peer_of(alice), "reported": EVE,
                                                                      "reason": "x"}
    status, body = issuer.handle("report", json.dumps(forged).encode())  # alice's name, mallory's key
    assert status == 400 and json.loads(body)["error"] == "token_invalid"
    with pytest.raises(InviteError):
        invites.report(url, alice, RUN, peer_of(alice), "itself")
    monkeypatch.setattr(org, "REPORTS_PER_HOUR", 2)
    assert invites.report(url, alice, RUN, EVE, "failed a check") == 1
    with pytest.raises(InviteError, match="At most 2 reports") as limited:
        invites.report(url, alice, RUN, EVE, "failed a check")
    assert limited.value.code == "invite_unreachable"  # try later: not a rejected token
    assert [(r.reported, r.reason) for r in issuer.store.reports()] == [
        (MALLORY, "returned a wrong average"), (MALLORY, "sent NaN or inf (3 times)"), (EVE, "failed a check")]


# ------------------------------------------------------------------- shared by the worker's averagers
# A worker's two averagers (gradients, state: two forked processes, as hivemind.Optimizer makes them)
# and an attacker's two. The attacker (a client: the worker's gradient averager reduces everything)
# sends NaN; one dropped part bans it there (STRIKES = 1). Then the worker's *state* averager meets
# the attacker: a round together, a download of its state, and the attacker's download of ours.
SHARED = """
import json, sys, time
import torch, hivemind
from hivemind.p2p import PeerID
from dedloc_core.engine import bans, hivemind_ext, robust
hivemind_ext.install()
robust.STRIKES = 1
first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
other = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                     initial_peers=[str(a) for a in first.get_visible_maddrs()])
attacker = str(other.peer_id)
opts = dict(target_group_size=2, min_matchmaking_time=3.0, request_timeout=1.0)
Averager = hivemind.averaging.DecentralizedAverager
# the attacker's averagers are forked before the worker makes its ban list: they have their own
bad_grad = Averager([torch.full((1000,), float("nan"))], dht=other, prefix="grad", client_mode=True, start=True,
                    **opts)
bad_state = Averager([torch.full((1000,), 5.0)], dht=other, prefix="state", start=True, **opts)
bans.load("shared_run")  # the worker, before hivemind forks its averagers
grad = Averager([torch.full((1000,), 1.0)], dht=first, prefix="grad", start=True, **opts)
state = Averager([torch.full((1000,), 1.0)], dht=first, prefix="state", start=True, **opts)
futures = [a.step(wait=False, timeout=30, allow_retries=False) for a in (grad, bad_grad)]
try:
    futures[0].result(timeout=60)
except Exception as exc:
    pass
deadline = time.monotonic() + 20
while not bans.banned(attacker) and time.monotonic() < deadline:
    time.sleep(0.1)
seen_in_main = bans.banned(attacker)
saved = [b["peer"] for b in json.loads(bans.file_for("shared_run").read_text())["bans"]]

futures = [a.step(wait=False, timeout=12, allow_retries=False) for a in (state, bad_state)]
outcomes = []
for f in futures:
    try:
        outcomes.append(len(f.result(timeout=60)))
    except Exception as exc:
        outcomes.append(type(exc).__name__)
with state.get_tensors() as tensors:
    state_value = float(tensors[0].mean())
deadline = time.monotonic() + 20  # the attacker's state is declared for download
while time.monotonic() < deadline:
    found = first.get("state.all_averagers", latest=True)
    if found and any(str(PeerID(k)) == attacker for k in found.value):
        break
    time.sleep(0.2)
got = state.load_state_from_peers(timeout=10)
gave = bad_state.load_state_from_peers(timeout=10)
print(json.dumps({"seen_in_main": seen_in_main, "saved": saved, "attacker": attacker, "outcomes": outcomes,
                  "state_value": state_value,
                  "downloaded": None if got is None else float(got[1][0].mean()),
                  "served": None if gave is None else float(gave[1][0].mean())}))
for a in (grad, state, bad_grad, bad_state):
    a.shutdown()
for d in (first, other):
    d.shutdown()
"""


@pytest.mark.slow
def test_a_peer_banned_by_one_averager_is_refused_by_the_others(tmp_path, monkeypatch):
    monkeypatch.setenv("DEDLOC_HOME", str(tmp_path))
    monkeypatch.delenv("DEDLOC_HELPER_THREADS", raising=False)  # averagers as forked processes
    seen = probe_json(SHARED, timeout=240)
    assert seen["seen_in_main"] and seen["saved"] == [seen["attacker"]], seen  # the main process sees it, saved
    assert seen["state_value"] == pytest.approx(1.0), seen  # no round with the attacker: (1 + 5) / 2 without
    assert all(isinstance(o, str) for o in seen["outcomes"]), seen
    assert seen["downloaded"] is None and seen["served"] is None, seen  # no state from it, none to it
