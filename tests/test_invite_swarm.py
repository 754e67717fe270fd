"""Invite-only averaging with real hivemind averagers on loopback (engine/gate.py, hivemind_ext
patch 8): three invited peers average together; intruders with no token, an expired token, a token
for another run, a token bound to another peer (stolen from an invited one) and a revoked volunteer
(its token lapsed after its renewal was refused) are never in their group, and the invited peers'
average is exactly theirs. The intruders run plain hivemind (no project code)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The invited peers: patched hivemind, the gate on; prints the tokens intruders may try, then waits
# for a start time on stdin and prints its peers' groups and averages.
HONEST = """
import json, logging, sys, tempfile, time
import torch, hivemind
from hivemind.p2p import P2P, PeerID
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from dedloc_core import invites
from dedloc_core.engine import gate, hivemind_ext, metrics
dht_auth, gate_on = sys.argv[1] == "dht-auth", sys.argv[2] == "gate"
RUN = "gated-run"
hivemind_ext.install()
logging.getLogger("hivemind.averaging.allreduce").setLevel(logging.DEBUG)  # why a round failed, if one does
issuer = Ed25519PrivateKey.generate()
if gate_on:
    gate.configure(RUN, invites.public_key_text(issuer))
def token(peer, run=RUN, lifetime=300.0, ago=0.0):
    now = time.time() - ago
    return invites.issue(issuer, invites.Claims(run, peer, now, now + lifetime, "inv-test"))
home = tempfile.mkdtemp()
dhts, tokens = [], []
for i in range(3):
    path = f"{home}/id{i}.key"
    P2P.generate_identity(path)
    peer = PeerID.from_identity(open(path, "rb").read()).to_base58()
    tokens.append(token(peer))
    extra = {}
    if dht_auth:
        extra["authorizer"] = gate.InviteAuthorizer(metrics.load_identity_key(path), gate.TokenHolder(tokens[-1]))
    initial = [str(a) for a in dhts[0].get_visible_maddrs()] if dhts else []
    dhts.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=path,
                             initial_peers=initial, **extra))
    if gate_on:
        gate.publish(dhts[-1], tokens[-1], subkey=peer)
print(json.dumps({"maddrs": [str(a) for a in dhts[0].get_visible_maddrs()],
                  "expired": token("x", ago=400.0), "other_run": token("x", run="other-run"),
                  "stolen": tokens[0], "revoked": token("x", lifetime=1.0)}), flush=True)
averagers = [hivemind.averaging.DecentralizedAverager([torch.full((1000,), v)], dht=d, prefix="gated",
             target_group_size=8, min_matchmaking_time=4.0, request_timeout=1.0, start=True)
             for v, d in zip([1.0, 1.2, 0.8], dhts)]
print("ready", flush=True)
start_at = float(sys.stdin.readline())
time.sleep(max(0.0, start_at - time.time()))
futures = [a.step(wait=False, timeout=40, allow_retries=False) for a in averagers]
groups = []
for f in futures:
    try:
        groups.append(sorted(str(p) for p in f.result()))
    except Exception as exc:
        groups.append(repr(exc)[:120])
values = []
for a in averagers:
    with a.get_tensors() as tensors:
        values.append([float(tensors[0].min()), float(tensors[0].max())])
print(json.dumps({"groups": groups, "values": values, "peers": [str(d.peer_id) for d in dhts]}), flush=True)
for a in averagers:
    a.shutdown()
for d in dhts:
    d.shutdown()
"""

# The intruders: hivemind's public API only. Each publishes the token it has (if any) where the
# invited peers publish theirs, then tries to average with value 1000.
INTRUDERS = """
import json, sys, time
import torch, hivemind
from hivemind.utils import get_dht_time
info = json.loads(sys.argv[1])
kinds = ["none", "expired", "other_run", "stolen", "revoked"]
dhts = []
for _ in kinds:  # each knows the invited peers and the other intruders
    initial = info["maddrs"] + [str(a) for d in dhts[:1] for a in d.get_visible_maddrs()]
    try:
        dhts.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial,
                                 ensure_bootstrap_success=False))
    except Exception:  # a gated swarm may refuse even the connection: then only the other intruders
        dhts.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial[1:],
                                 ensure_bootstrap_success=False))
for kind, dht in zip(kinds, dhts):
    if kind != "none":
        dht.store("gated-run_invites", subkey=str(dht.peer_id), value=info[kind],
                  expiration_time=get_dht_time() + 300)
averagers = [hivemind.averaging.DecentralizedAverager([torch.full((1000,), 1000.0)], dht=d, prefix="gated",
             target_group_size=8, min_matchmaking_time=4.0, request_timeout=1.0, start=True) for d in dhts]
print("ready", flush=True)
start_at = float(sys.stdin.readline())
time.sleep(max(0.0, start_at - time.time()))
futures = [a.step(wait=False, timeout=40, allow_retries=False) for a in averagers]
groups = []
for f in futures:
    try:
        groups.append(sorted(str(p) for p in f.result()))
    except Exception as exc:
        groups.append(repr(exc)[:120])
print(json.dumps({"peers": [str(d.peer_id) for d in dhts], "groups": groups}), flush=True)
for a in averagers:
    a.shutdown()
for d in dhts:
    d.shutdown()
"""


def run_swarm(dht_auth: bool, gate_on: bool) -> tuple[dict, dict]:
    honest = subprocess.Popen([sys.executable, "-c", HONEST, "dht-auth" if dht_auth else "no-dht-auth",
                               "gate" if gate_on else "no-gate"], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        info = json.loads(honest.stdout.readline())
        time.sleep(2.0)  # the "revoked" token (1 s) has lapsed
        proc = subprocess.Popen([sys.executable, "-c", INTRUDERS, json.dumps(info)], cwd=ROOT, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for side in (honest, proc):  # both sides' averagers are up (however loaded the machine)
            assert side.stdout.readline().strip() == "ready", side.stderr.read()[-3000:]
        start_at = time.time() + 3.0
        for side in (honest, proc):
            side.stdin.write(f"{start_at}\n")
            side.stdin.flush()
        out, err = honest.communicate(timeout=150)
        assert honest.returncode == 0, err[-3000:]
        iout, ierr = proc.communicate(timeout=150)
        assert proc.returncode == 0, ierr[-3000:]
        honest_out, intruders_out = json.loads(out.strip().splitlines()[-1]), json.loads(iout.strip().splitlines()[-1])
        honest_out["log"], intruders_out["log"] = err[-6000:], ierr[-3000:]  # shown when a check fails
        return honest_out, intruders_out
    finally:
        for p in (honest, locals().get("proc")):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def shown(side: dict) -> str:
    return f"groups: {side['groups']}\n{side['log']}"


def check_closed(honest: dict, intruders: dict) -> None:
    bad = set(intruders["peers"])
    for group in honest["groups"]:
        assert isinstance(group, list) and sorted(group) == sorted(honest["peers"]), shown(honest)
        assert not bad & set(group)
    for group in intruders["groups"]:
        assert not (isinstance(group, list) and set(group) & set(honest["peers"])), shown(intruders)
    for low, high in honest["values"]:
        assert low == pytest.approx(1.0, abs=1e-4) and high == pytest.approx(1.0, abs=1e-4), shown(honest)


@pytest.mark.slow
def test_intruders_never_join_a_gated_swarm():
    # the real setup: tokens in every DHT message and in matchmaking and all-reduce
    check_closed(*run_swarm(dht_auth=True, gate_on=True))


@pytest.mark.slow
def test_matchmaking_and_allreduce_checks_hold_without_the_dht_authorizer():
    # patch 8 alone: the intruders can read the DHT (no authorizer), find the group key, ask to join
    check_closed(*run_swarm(dht_auth=False, gate_on=True))


@pytest.mark.slow
def test_without_the_gate_intruders_join_the_average():
    # what patch 8 is for: with the same setup and the gate off, intruders are taken in
    honest, intruders = run_swarm(dht_auth=False, gate_on=False)
    assert any(isinstance(g, list) and set(g) & set(intruders["peers"]) for g in honest["groups"]), shown(honest)
