"""The swarm's first step, for a peer that was not in it: the state it is served holds that step
(``prefetch._ServesWholeSteps``), and a peer that went on without its first step loads that state,
dropping the samples it computed on the initial parameters (``swarm.RoundCountingOptimizer._go_on_from``).
Real hivemind DHTs, optimizers and averager processes on loopback; the download goes over p2p as a
newcomer's does."""

from __future__ import annotations

import pytest
from probes import probe_json

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast

SERVED = """
import json, sys, time
import torch
from dedloc_core.engine import prefetch
from tests.probes import lone_optimizer

if sys.argv[1] == "unwaited":
    prefetch._ServesWholeSteps.STEP_WAIT = 0.0
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
dht, opt = lone_optimizer("served", model, lr=0.1, overlap=True, target_batch_size=8)
plain_do = opt.state_averager._do

def after_a_round(*args, **kwargs):  # the step's background task: its gradient round first (1.5 s)
    time.sleep(1.5)
    return plain_do(*args, **kwargs)

opt.state_averager._do = after_a_round
offloaded = lambda: torch.cat([p.detach().reshape(-1).clone()
                               for p in opt.state_averager.optimizer.param_groups[0]["params"]])
before = offloaded()
while opt.local_epoch < 1:  # two micro-batches: the target; the step runs in the background
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
metadata, tensors, infos = opt.state_averager.get_current_state()  # what a newcomer asking now gets
served = tensors[0][: before.numel()]  # packed: the parameters first, in order
opt.state_averager.step(wait_for_delayed_updates=True)
after = offloaded()
print(json.dumps(dict(epoch=metadata["epoch"], stepped=not torch.equal(before, after),
                      served_step=torch.equal(served, after), served_before=torch.equal(served, before))))
opt.shutdown(); dht.shutdown()
"""

SWARM = """
import json, sys
import torch
from tests.probes import lone_optimizer

fast = dict(min_refresh_period=0.2, max_refresh_period=0.5, default_refresh_period=0.2, progress_report_period=0.5)
torch.manual_seed(0)  # (every peer builds the recipe's model from one seed)
model = torch.nn.Linear(8, 4)
dht, opt = lone_optimizer("newcomer", model, lr=0.1, overlap=True, target_batch_size=8, **fast)
while opt.local_epoch < 1:  # the swarm's first step, without the newcomer
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
opt.state_averager.step(wait_for_delayed_updates=True)
model(torch.randn(4, 8)).square().mean().backward()
opt.step()  # a micro-batch of step 1: the swarm reports that step's progress
adam = opt.state_averager.optimizer
params = adam.param_groups[0]["params"]
print(json.dumps(dict(maddrs=[str(a) for a in dht.get_visible_maddrs()],
                      params=torch.cat([p.detach().reshape(-1) for p in params]).tolist(),
                      sq=adam.state[params[0]]["exp_avg_sq"].reshape(-1).tolist(),
                      step=int(adam.state[params[0]]["step"]))), flush=True)
sys.stdin.read()  # until the newcomer is done
opt.shutdown(); dht.shutdown()
"""

NEWCOMER = """
import json, os, signal, subprocess, sys, time
import torch
from dedloc_core.engine import swarm
from tests.probes import lone_optimizer

if sys.argv[1] == "going-on":  # as before: a newcomer goes on like any peer, its optimizer owing the step
    swarm.RoundCountingOptimizer._go_on_from = swarm.RoundCountingOptimizer._go_on_at
peer = subprocess.Popen([sys.executable, "-c", sys.argv[2]], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                        start_new_session=True)
swarm_state = json.loads(peer.stdout.readline())  # another process: its own key signs its progress records
fast = dict(min_refresh_period=0.2, max_refresh_period=0.5, default_refresh_period=0.2, progress_report_period=0.5)
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
dht, opt = lone_optimizer("newcomer", model, lr=0.1, overlap=True, target_batch_size=8,
                          initial_peers=swarm_state["maddrs"], **fast)
deadline = time.monotonic() + 60
while opt.tracker.global_epoch < 1:  # its tracker has read the swarm's progress: the swarm is at step 1
    assert time.monotonic() < deadline, "the newcomer never saw the swarm's step"
    time.sleep(0.1)
# It began training with the swarm at step 0 (in the lab it was late to the first round): hivemind's exact
# check of the step, once per step and first thing, found it in step and is spent (else hivemind loads the
# state and drops the samples)
opt._should_check_synchronization_on_update = False
while opt.local_epoch < 1:  # its micro-batches until it sees the swarm's step and goes on
    assert time.monotonic() < deadline, "the newcomer never went on"
    fresh = opt.grad_averager.local_samples_accumulated < 4
    if fresh:
        model(torch.randn(4, 8)).square().mean().backward()
    opt.step(batch_size=4 if fresh else 0)
    time.sleep(0.2)
adam = opt.state_averager.optimizer
params = adam.param_groups[0]["params"]
ours = torch.cat([p.detach().reshape(-1) for p in params])
sq, swarm_sq = adam.state[params[0]]["exp_avg_sq"].reshape(-1), torch.tensor(swarm_state["sq"])
print(json.dumps(dict(epoch=opt.local_epoch, samples=opt.grad_averager.local_samples_accumulated,
                      dropped=opt.samples_dropped,
                      owed=opt._owed_steps.owed, steps=[swarm_state["step"], int(adam.state[params[0]]["step"])],
                      param_gap=float((ours - torch.tensor(swarm_state["params"])).abs().max()),
                      moment_gap=float(((sq - swarm_sq).abs() / swarm_sq.abs().clamp_min(1e-12)).max()))))
peer.stdin.close()
try:
    peer.wait(20)
except subprocess.TimeoutExpired:  # its shutdown hung: the peer, its averagers, DHT and p2pd go at once
    os.killpg(peer.pid, signal.SIGKILL)
    peer.wait(20)
opt.shutdown(); dht.shutdown()
"""


def test_a_state_asked_for_during_a_delayed_step_is_served_once_the_step_is_in_it():
    out = probe_json(SERVED, "patched", timeout=180)
    assert out["epoch"] == 1 and out["stepped"]
    assert out["served_step"] and not out["served_before"]


def test_without_the_wait_it_served_step_1_with_step_0s_parameters():
    out = probe_json(SERVED, "unwaited", timeout=180)
    assert out["epoch"] == 1 and out["served_before"] and not out["served_step"]


def test_a_newcomer_that_missed_the_first_step_loads_the_swarms_state():
    out = probe_json(NEWCOMER, "patched", SWARM, timeout=240)
    assert out["epoch"] == 1 and out["samples"] == 0 and out["owed"] == 0  # its initial model's samples dropped
    assert out["dropped"] == 4  # and not counted as its contribution (training.py)
    assert out["steps"][0] == out["steps"][1] == 1  # Adam's step count: the swarm's
    assert out["param_gap"] < 1e-3  # the swarm's parameters (sent in fp16)
    assert out["moment_gap"] < 1e-2  # and its statistics (sent in bfloat16)


def test_going_on_instead_left_it_without_the_swarms_first_update():
    out = probe_json(NEWCOMER, "going-on", SWARM, timeout=240)
    assert out["epoch"] == 1 and out["samples"] == 4 and out["owed"] == 1 and out["dropped"] == 0
    assert out["param_gap"] > 0.05  # its own initial parameters against a step of Adam at lr 0.1
