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
