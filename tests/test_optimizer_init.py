"""A swarm's first optimizer step is the recipe optimizer's first step: hivemind makes Adam's
statistics exist with a step of zero gradients before training (``initialize_optimizer_state_``),
which left Adam's step count at 1 (every later update with the next step's bias correction) and
AdamW's weight decay applied once (``hivemind_ext.optimizer_init``). Real hivemind optimizers on a
loopback DHT, in a fresh interpreter each, against plain ``torch.optim.AdamW``."""

from __future__ import annotations

import pytest
from probes import probe_json

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast

PROBE = """
import copy, json, sys, torch
from dedloc_core.engine import hivemind_ext
from tests.probes import lone_optimizer

hivemind_ext.install(skip=sys.argv[2:])  # before lone_optimizer's (a second install does nothing)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
reference = copy.deepcopy(model)
x = torch.randn(4, 3)  # the same micro-batch each time: the step's mean gradient is this one's
dht, opt = lone_optimizer("first_step_" + sys.argv[1], model, lr=0.1, overlap=sys.argv[1] == "overlap",
                          target_batch_size=8)
adam = opt.state_averager.optimizer
steps_before = [int(s["step"]) for s in adam.state.values()]
while opt.local_epoch < 1:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
opt.state_averager.step(wait_for_delayed_updates=True)  # with overlap: the step ran in the background
torch_adamw = torch.optim.AdamW(reference.parameters(), lr=0.1)
reference(x).square().mean().backward()
torch_adamw.step()
gap = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), reference.parameters()))
print(json.dumps(dict(steps_before=sorted(set(steps_before)), gap=gap,
                      steps=sorted({int(s["step"]) for s in adam.state.values()}))))
opt.shutdown()
dht.shutdown()
"""


@pytest.mark.parametrize("mode", ["plain", "overlap"])
def test_the_first_global_step_is_adamws_first_step(mode):
    got = probe_json(PROBE, mode, timeout=180)
    assert got["steps_before"] == [0], got  # the statistics exist, no step counted
    assert got["steps"] == [1], got
    # torch's first AdamW step moves each weight by about lr (0.1); with a step counted before it,
    # by 0.73 lr: a gap of 0.027
    assert got["gap"] < 1e-6, got


def test_without_optimizer_init_the_first_step_is_adams_second():
    got = probe_json(PROBE, "plain", "optimizer_init", timeout=180)
    assert got["steps_before"] == [1], got  # hivemind's zero step counted
    assert got["gap"] > 0.01, got  # the update with the next step's bias correction (and one decay)
