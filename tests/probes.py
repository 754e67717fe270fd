"""What the probe scripts share: they run in a fresh interpreter (``python -c`` in the repository's
root), so a probe imports this as ``tests.probes``. Real hivemind DHTs on loopback. The tests start
them with ``run_probe`` / ``probe_json`` (imported as ``probes``: no torch in pytest's process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]


def run_probe(code: str, *args: str, timeout: float = 120) -> str:
    """Run a probe script in a fresh interpreter in the repository's root: its stdout, stripped (the
    test fails with the end of its stderr if it exits non-zero)."""
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def probe_json(code: str, *args: str, timeout: float = 120):
    """The JSON a probe script prints last (``run_probe``)."""
    return json.loads(run_probe(code, *args, timeout=timeout).splitlines()[-1])


def until(condition, what: str, timeout: float = 60.0, poll: float = 0.05) -> None:
    """Wait for ``condition()`` in a probe; fail with ``what`` after ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(poll)


# a tracker that reads the swarm's progress every 0.2-0.5 s, so a probe sees a step at once
FAST_TRACKER = dict(min_refresh_period=0.2, max_refresh_period=0.5, default_refresh_period=0.2)


def lone_optimizer(run_id: str, model: torch.nn.Module, *, lr: float, overlap: bool, target_batch_size: int,
                   batch_size_per_step: int = 4, **fields):
    """A lone peer's optimizer as the worker builds it (``swarm.build_optimizer``, AdamW at ``lr``)
    on a fresh DHT: ``(dht, optimizer)``. ``fields``: more of its ``SwarmConfig`` (``initial_peers``:
    a peer that joins those; matchmaking 0.5 s and a 5 s timeout unless given)."""
    import torch

    from dedloc_core.engine import swarm

    class Recipe:
        build_scheduler = None

        @staticmethod
        def build_optimizer(params):
            return torch.optim.AdamW(params, lr=lr)

    swarm.prepare_process()
    cfg = swarm.SwarmConfig(run_id=run_id, target_batch_size=target_batch_size,
                            batch_size_per_step=batch_size_per_step, overlap=overlap,
                            **{"matchmaking_time": 0.5, "averaging_timeout": 5.0, **fields})
    dht = swarm.start_dht(cfg)
    return dht, swarm.build_optimizer(dht, cfg, model, Recipe)


def two_dhts():
    """Two connected DHTs on loopback, ``(ours, another peer's)``, with our patches installed."""
    import hivemind

    from dedloc_core.engine import hivemind_ext

    hivemind_ext.install()
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    other = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs())
    return first, other
