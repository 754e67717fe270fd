"""A worker's DHT comes up on a busy computer: its p2pd may take longer than hivemind's 15 s to
answer (several workers starting on a third of a core did in ``bench/scale.py``), and the worker
waits for it (``swarm.P2PD_STARTUP_SECONDS``) instead of crashing. Here the real p2pd is held
stopped (SIGSTOP) for 20 s as it starts."""

from __future__ import annotations

import pytest
from probes import run_probe

pytestmark = pytest.mark.slow

PROBE = """
import os, signal, sys, threading, time
import psutil
from dedloc_core.engine import swarm
swarm.prepare_process()
held = []

def hold_p2pd():  # the first p2pd this process starts: stopped for 20 s, then let go
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not held:
        for child in psutil.Process().children(recursive=True):
            if child.name() == "p2pd":
                child.send_signal(signal.SIGSTOP)
                held.append(time.monotonic())
                time.sleep(20)
                child.send_signal(signal.SIGCONT)
                return
        time.sleep(0.01)

threading.Thread(target=hold_p2pd, daemon=True).start()
if sys.argv[1] == "hivemind":
    swarm.P2PD_STARTUP_SECONDS = 15.0
began = time.monotonic()
try:
    dht = swarm.start_dht(swarm.SwarmConfig(run_id="slow", target_batch_size=1, batch_size_per_step=1))
    print("up", round(time.monotonic() - began), bool(held))
    dht.shutdown()
except Exception as exc:
    print("failed", type(exc).__name__, bool(held))
"""


def test_a_dht_whose_p2pd_is_slow_to_start_still_comes_up():
    assert run_probe(PROBE, "ours", timeout=180).splitlines()[-1].startswith("up "), "the DHT did not come up"


def test_with_hiveminds_startup_timeout_it_fails():  # the test above is one that could fail
    assert run_probe(PROBE, "hivemind", timeout=180).splitlines()[-1] == "failed P2PDaemonError True"


LATE_BACKBONE = """
import socket, sys, tempfile, threading, time
import hivemind
from hivemind.p2p import P2P, PeerID
from dedloc_core.engine import swarm
swarm.prepare_process()
with socket.socket() as s:  # a free port for the backbone that comes up late
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
identity = tempfile.mkdtemp() + "/backbone.key"
P2P.generate_identity(identity)
peer = PeerID.from_identity(open(identity, "rb").read()).to_base58()
backbone = []
def start_backbone():
    time.sleep(3)
    backbone.append(hivemind.DHT(start=True, host_maddrs=[f"/ip4/127.0.0.1/tcp/{port}"], identity_path=identity))
threading.Thread(target=start_backbone, daemon=True).start()
if sys.argv[1] == "once":
    swarm.BOOTSTRAP_TRIES = 1
cfg = swarm.SwarmConfig(run_id="late", target_batch_size=1, batch_size_per_step=1,
                        initial_peers=[f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer}"])
try:
    dht = swarm.start_dht(cfg)
    print("up", len(backbone))
    dht.shutdown()
except Exception as exc:
    print("failed", type(exc).__name__, swarm.BOOTSTRAP_FAILED in str(exc))
time.sleep(max(0, 4 - len(backbone)))
for d in backbone:
    d.shutdown()
"""


def test_a_worker_whose_backbone_is_not_up_yet_tries_again_and_joins():
    assert run_probe(LATE_BACKBONE, "again", timeout=120).splitlines()[-1] == "up 1"


def test_without_the_retries_it_fails_at_once():  # the test above is one that could fail
    assert run_probe(LATE_BACKBONE, "once", timeout=120).splitlines()[-1] == "failed P2PDaemonError True"
