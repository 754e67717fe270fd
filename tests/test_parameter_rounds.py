"""A parameter round that finds no group is left at the next step, not waited for
(``engine.parameter_rounds``). Two real hivemind optimizers on
loopback (overlap, as the worker runs them), each in its own process: A averages its
parameters every step, B never (as a peer that skipped the step's parameter round), so each of A's
parameter rounds looks for a group alone. With the rule A's next step goes on at once; without it
each step waited for the lone round until its deadline (the averaging timeout, 8 s here)."""

from __future__ import annotations

from statistics import median

import pytest
from probes import probe_json

pytestmark = pytest.mark.slow  # starts hivemind peers: not in make test-fast

PEER_B = """
import sys, threading, time
import torch
from tests.probes import lone_optimizer

torch.manual_seed(1)
model = torch.nn.Linear(8, 4)
dht, opt = lone_optimizer("lone-params", model, lr=0.01, overlap=True, target_batch_size=64,
                          average_state_every=10**6, initial_peers=sys.argv[1].split(), **eval(sys.argv[2]))
print("ready", flush=True)
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
while not stop.is_set():  # until A is done
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    time.sleep(0.25)
opt.shutdown(); dht.shutdown()
"""

PAIR = """
import json, subprocess, sys, time
import torch
from dedloc_core.engine import parameter_rounds
from tests.probes import lone_optimizer

if sys.argv[1] == "waiting":
    parameter_rounds.LeavesLoneParameterRounds._wait_leaving_lone_rounds = lambda self: None
fast = dict(min_refresh_period=0.2, max_refresh_period=0.5, default_refresh_period=0.2, progress_report_period=0.5,
            averaging_timeout=8.0)
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
dht, a = lone_optimizer("lone-params", model, lr=0.01, overlap=True, target_batch_size=64, average_state_every=1,
                        **fast)
b = subprocess.Popen([sys.executable, "-c", sys.argv[2], " ".join(str(x) for x in dht.get_visible_maddrs()),
                      repr(fast)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
assert b.stdout.readline().strip() == "ready"
waits = []  # A's waits for its delayed updates, at each step's beginning
plain_step = a.state_averager.step

def timed_step(*args, **kwargs):
    began = time.monotonic()
    try:
        return plain_step(*args, **kwargs)
    finally:
        if kwargs.get("wait_for_delayed_updates"):
            waits.append(round(time.monotonic() - began, 2))

a.state_averager.step = timed_step
began = time.monotonic()
while a.local_epoch < 8 and time.monotonic() - began < 90:
    model(torch.randn(4, 8)).square().mean().backward()
    a.step()
    time.sleep(0.25)
print(json.dumps(dict(epoch=a.local_epoch, seconds=round(time.monotonic() - began, 1), waits=waits,
                      left=a.state_averager.parameter_rounds_left)))
b.stdin.close()
b.wait(30)
a.shutdown(); dht.shutdown()
"""


def test_a_lone_parameter_round_is_left_at_the_next_step():
    out = probe_json(PAIR, "leaving", PEER_B, timeout=150)
    later = out["waits"][2:]  # the first steps: no parameter round yet (no timing of its own) or the first
    assert out["epoch"] >= 8, out
    assert out["left"] >= 3 and later and median(later) < 1.0, out


def test_without_leaving_each_step_waits_for_the_lone_round():
    out = probe_json(PAIR, "waiting", PEER_B, timeout=150)
    later = out["waits"][2:]
    assert out["left"] == 0 and later and median(later) > 3.0, out
