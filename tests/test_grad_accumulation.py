"""A step's micro-batches accumulate in the parameters' ``.grad`` (``accumulate_in_grads``, sync mode
with overlap): what a step averages, falls back to and applies is still the mean of its micro-batches'
gradients. Real hivemind optimizers on a loopback DHT, in a fresh interpreter each."""

from __future__ import annotations

import pytest
from probes import probe_json

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast

PROBE = """
import dataclasses, json, sys, torch
from dedloc_core.engine import swarm

class Recipe:
    build_scheduler = None
    @staticmethod
    def build_optimizer(params):
        return torch.optim.SGD(params, lr=1.0)

overlap = sys.argv[1] == "overlap"
swarm.prepare_process()
torch.manual_seed(0)
model = torch.nn.Linear(3, 2)
cfg = swarm.SwarmConfig(run_id="grad_acc_" + sys.argv[1], target_batch_size=12, batch_size_per_step=4,
                        overlap=overlap, matchmaking_time=0.5, averaging_timeout=5.0)
dht = swarm.start_dht(cfg)
opt = swarm.build_optimizer(dht, cfg, model, Recipe)
batches = [torch.randn(4, 3) for _ in range(5)]

def grads(x):  # this micro-batch's gradient alone
    g = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
    return [t.clone() for t in g]

def micro(x):
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()

# 1. a discarded micro-batch (a state load resets the accumulators) leaves nothing behind
micro(batches[4])
opt.grad_averager.reset_accumulated_grads_()
discarded = all(float(p.grad.abs().sum()) == 0 for p in model.parameters())

# 2. two micro-batches, then what the step's end keeps for a failed round (the local gradients)
want = [sum(ts) / 2 for ts in zip(grads(batches[0]), grads(batches[1]))]
micro(batches[0])
micro(batches[1])
in_grads = [p.grad.clone() for p in model.parameters()]
opt.tracker.global_progress = dataclasses.replace(opt.tracker.global_progress, num_peers=2)
began = opt._begin_averaging_gradients(None)
local = [t.clone() for t in opt._local_grads] if opt._local_grads is not None else None
if opt.scheduled_grads is not None:
    opt.scheduled_grads.cancel()
opt.scheduled_grads, opt._local_grads = None, None
with opt.grad_averager.get_tensors() as averaged:
    loaded = [t.clone() for t in averaged]
after = [p.grad.clone() for p in model.parameters()]
opt.grad_averager.reset_accumulated_grads_()

# 3. a lone peer's whole step (3 micro-batches of 4 = the target batch): SGD at lr 1 moves the
# parameters by the mean of the 3 gradients
opt.tracker.global_progress = dataclasses.replace(opt.tracker.global_progress, num_peers=1)
before = [p.detach().clone() for p in model.parameters()]
step_want = [sum(ts) / 3 for ts in zip(*(grads(x) for x in batches[1:4]))]
epoch = opt.local_epoch
for x in batches[1:4]:
    micro(x)  # the third reaches the target batch: a lone peer steps at once
stepped = opt.local_epoch == epoch + 1
opt.state_averager.step(wait_for_delayed_updates=True, apply_delayed_updates=True)
moved = [b - p.detach() for b, p in zip(before, model.parameters())]

def close(a, b):
    return a is not None and all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a, b, strict=True))

print(json.dumps(dict(
    lazy=getattr(opt.grad_averager, "accumulate_in_grads", False), stepped=stepped, discarded=discarded, began=began,
    grads_held=close(in_grads, [2 * w for w in want]) if overlap else None,
    local=close(local, want) if overlap else None, loaded=close(loaded, want),
    zeroed=all(float(t.abs().sum()) == 0 for t in after) if overlap else None,
    step=close(moved, step_want), moved=[float(t.abs().sum()) for t in moved])))
opt.shutdown()
dht.shutdown()
"""


def run(mode: str) -> dict:
    return probe_json(PROBE, mode, timeout=180)


def test_overlap_accumulates_in_grads_and_steps_on_the_mean_gradient():
    got = run("overlap")
    assert got["lazy"], got
    assert got["discarded"], got  # a reset drops the micro-batches still in .grad
    assert got["grads_held"], got  # two micro-batches' sum in .grad: no copy, no zero_grad between them
    assert got["began"], got
    assert got["local"], got  # the failed round's fallback: the mean of the step's own micro-batches
    assert got["loaded"], got  # what the round averages
    assert got["zeroed"], got  # .grad is free for the next step's micro-batches
    assert got["stepped"] and got["step"], got  # a lone step: SGD moved the parameters by the mean gradient


def test_without_overlap_gradients_are_copied_per_micro_batch_as_hivemind_does():
    got = run("plain")
    assert not got["lazy"], got
    assert got["discarded"] and got["loaded"] and got["stepped"] and got["step"], got
