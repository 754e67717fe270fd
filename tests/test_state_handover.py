"""A peer serving its state to a newcomer hands it to its averager's process packed, one buffer per
dtype (``prefetch._HandsOverPacked``), and the newcomer gets the same state as hivemind would send.
Real DHTs, a real Optimizer and its averager process, the newcomer's download on loopback."""

from __future__ import annotations

import pytest
from probes import probe_json

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast

PROBE = """
import json, time
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.optim import state_averager as hivemind_state
from dedloc_core.engine import prefetch, swarm
from tests.probes import lone_optimizer

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
dht, opt = lone_optimizer("handover", model, lr=1e-2, overlap=False, target_batch_size=8)
while opt.local_epoch < 3:  # a lone peer's steps: a state with Adam's statistics, at step 3
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    opt.zero_grad()
averager = opt.state_averager
_, handed, infos = averager.get_current_state()  # what crosses the pipe to the averager's process
_, plain, _ = hivemind_state.TrainingStateAverager.get_current_state(averager)  # hivemind's: one each

newcomer = swarm.start_dht(swarm.SwarmConfig(run_id="handover", target_batch_size=8, batch_size_per_step=4,
                                             initial_peers=[str(a) for a in dht.get_visible_maddrs()]))
newcomer.add_validators([RSASignatureValidator()])  # the progress records are signed
deadline = time.monotonic() + 60
got = None
while got is None and time.monotonic() < deadline:  # until the peer has declared its state (and sent it whole)
    got = prefetch.start(newcomer, "handover", timeout=10, expected=len(plain)).result(timeout=30)
    time.sleep(0.5)
assert got is not None, "no state downloaded"
metadata, tensors = got
same_shapes = [list(t.shape) for t in tensors] == [list(p.shape) for p in plain]
errors = [float((t.float() - p.float()).abs().max() / max(float(p.abs().max()), 1e-30)) for t, p in zip(tensors, plain)]
print(json.dumps(dict(handed=len(handed), infos=len(infos), tensors=len(plain), received=len(tensors),
                      epoch=metadata["epoch"], shapes=same_shapes,
                      error=max(errors))))
opt.shutdown()
newcomer.shutdown()
dht.shutdown()
"""


def test_the_state_crosses_to_the_averager_packed_and_reaches_the_newcomer_whole():
    got = probe_json(PROBE, timeout=240)
    assert got["tensors"] > 10 and got["infos"] == got["tensors"], got  # 6 parameters, 3 Adam tensors each
    assert got["handed"] == 1, got  # all fp32: one buffer instead of one per tensor
    assert got["received"] == got["tensors"] and got["shapes"], got
    assert got["epoch"] >= 3, got
    assert got["error"] <= 2 ** -8, got  # fp16 parameters, bfloat16 statistics (load_state_compression)


SHORT = """
import json, sys, time
import torch
from hivemind.dht.crypto import RSASignatureValidator
from dedloc_core.engine import prefetch, swarm
from tests.probes import lone_optimizer

host_state = prefetch._HandsOverPacked._get_current_state_from_host_process


async def short(self):  # the serving side sends a state that stops after half its tensors, without an error
    metadata, tensors, infos = await host_state(self)
    return metadata, tensors[: len(tensors) // 2], infos[: len(infos) // 2]


prefetch._HandsOverPacked._get_current_state_from_host_process = short  # (the averager's process is forked)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
dht, opt = lone_optimizer("short", model, lr=1e-2, overlap=False, target_batch_size=8)
while opt.local_epoch < 3:
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    opt.zero_grad()
whole = len(opt.state_averager.get_current_state()[2])
newcomer = swarm.start_dht(swarm.SwarmConfig(run_id="short", target_batch_size=8, batch_size_per_step=4,
                                             initial_peers=[str(a) for a in dht.get_visible_maddrs()]))
newcomer.add_validators([RSASignatureValidator()])
deadline, unchecked = time.monotonic() + 60, None
while unchecked is None and time.monotonic() < deadline:  # until the peer has declared its state
    unchecked = prefetch.start(newcomer, "short", timeout=10).result(timeout=30)
    time.sleep(0.5)
checked = prefetch.start(newcomer, "short", timeout=10, expected=whole).result(timeout=30)
print(json.dumps(dict(whole=whole, unchecked=None if unchecked is None else len(unchecked[1]),
                      checked=None if checked is None else len(checked[1]))))
opt.shutdown()
newcomer.shutdown()
dht.shutdown()
"""


def test_a_state_that_comes_short_is_not_taken():
    got = probe_json(SHORT, timeout=240)
    assert got["unchecked"] == got["whole"] // 2 > 0, got  # the stream did end early, without an error
    assert got["checked"] is None, got  # told how many to expect, the newcomer does not take it

