"""``engine.no_dynamo``: torch.optim trains without importing torch._dynamo (1.3 s of CPU and 75 MiB
per process), gives the same numbers, and anything that needs the real module still gets it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast

ROOT = Path(__file__).resolve().parents[1]

TRAIN = """
import json, sys
import torch
from dedloc_core.engine import no_dynamo
if sys.argv[1] == "stand-in":
    from dedloc_core.engine import swarm  # what the worker imports: installs the stand-in
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
for _ in range(10):
    opt.zero_grad()
    model(torch.randn(8, 16)).square().mean().backward()
    opt.step()
    sched.step()
opt.load_state_dict(opt.state_dict())
opt.step()
real = [m for m in sys.modules if m.startswith("torch._dynamo.") or m == "torch._inductor"]
print(json.dumps(dict(stand_in=no_dynamo.installed(), real=real,
                      params=[p.detach().flatten().tolist() for p in model.parameters()])))
"""

SWARM = """
import json, sys
from dedloc_core.engine import no_dynamo, swarm  # the stand-in goes in with swarm, before torch.optim is used
import torch
from tests.probes import lone_optimizer

model = torch.nn.Linear(8, 8)
dht, opt = lone_optimizer("no_dynamo", model, lr=1e-3, overlap=True, target_batch_size=16)
for _ in range(6):  # a lone peer: local steps through hivemind's Optimizer, background step included
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
epoch = opt.local_epoch
opt.shutdown()
dht.shutdown()
print(json.dumps(dict(stand_in=no_dynamo.installed(), epoch=epoch)))
"""

FALLBACK = """
import json, sys
import torch
from dedloc_core.engine import no_dynamo
no_dynamo.install()
first = no_dynamo.installed()
import torch._dynamo.config  # a submodule: the real package comes in the stand-in's place
after_submodule = no_dynamo.installed()
reset = torch._dynamo.reset  # a name the stand-in does not have
reset()
print(json.dumps(dict(first=first, after_submodule=after_submodule,
                      real=type(sys.modules["torch._dynamo"]).__name__, config=hasattr(torch._dynamo, "config"))))
"""

RACE = """
import json, threading
import torch
from dedloc_core.engine import no_dynamo
no_dynamo.install()
stand_in = torch._dynamo
start = threading.Barrier(6)
got, errors = [], []
def ask():  # six threads ask the stand-in for a name it does not have, at once
    start.wait()
    try:
        got.append(stand_in.reset is not None)
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=ask) for _ in range(6)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(dict(got=len(got), errors=errors)))
"""


def run(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_training_with_the_stand_in_imports_no_dynamo_and_gives_the_same_parameters():
    plain, stood_in = run(TRAIN, "plain"), run(TRAIN, "stand-in")
    assert not plain["stand_in"] and plain["real"], "torch.optim no longer imports torch._dynamo: drop no_dynamo"
    assert stood_in["stand_in"] and stood_in["real"] == [], stood_in["real"]
    assert stood_in["params"] == plain["params"]


def test_hivemind_optimizer_runs_on_the_stand_in():
    got = run(SWARM)
    assert got["epoch"] >= 1, got
    assert got["stand_in"], "something in the worker's optimizer path imported the real torch._dynamo"


def test_anything_else_gets_the_real_module():
    got = run(FALLBACK)
    assert got == dict(first=True, after_submodule=False, real="module", config=True), got


def test_threads_asking_at_once_all_get_the_whole_real_module():
    got = run(RACE)
    assert got == dict(got=6, errors=[]), got  # none got a half-imported module
