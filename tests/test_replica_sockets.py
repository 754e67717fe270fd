"""A worker session leaves no p2p socket behind: each hivemind averager talks to p2pd through a
replica of the DHT's ``P2P`` whose client listens on a unix socket, and hivemind never shut the
replicas down, so two ``hivemind-p2pclient-*.sock`` files stayed in /tmp per session
(``hivemind_ext.replica_sockets``). A real optimizer (DHT, two averager processes, p2pd) on loopback,
in a fresh interpreter, its sockets under ``tmp_path`` instead of /tmp."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import pathlib, sys, torch
from hivemind.p2p import P2P
from dedloc_core.engine import hivemind_ext
from tests.probes import lone_optimizer

hivemind_ext.install(skip=sys.argv[2:])  # before lone_optimizer's (a second install does nothing)

P2P._UNIX_SOCKET_PREFIX = "/unix" + sys.argv[1] + "/hivemind-"  # the forked helpers inherit it
model = torch.nn.Linear(3, 2)
dht, opt = lone_optimizer("sockets", model, lr=0.1, overlap=True, target_batch_size=8)
for _ in range(3):  # a few micro-batches: the averagers are up and serving
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    opt.zero_grad()
print("while training:", sorted(p.name.split("-")[1] for p in pathlib.Path(sys.argv[1]).iterdir()))
opt.shutdown()
dht.shutdown()
"""


def session(where: Path, *skip: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE, str(where), *skip], cwd=ROOT, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_a_session_leaves_no_socket_files(tmp_path):
    out = session(tmp_path)
    # the DHT's own client and daemon sockets, and one client per averager (gradients, state)
    assert "while training: ['p2pclient', 'p2pclient', 'p2pclient', 'p2pd']" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_without_replica_sockets_each_averagers_socket_stays(tmp_path):
    session(tmp_path, "replica_sockets")
    assert sorted(p.name.split("-")[1] for p in tmp_path.iterdir()) == ["p2pclient", "p2pclient"]
