"""What the probe scripts share: they run in a fresh interpreter (``python -c`` in the repository's
root), so a probe imports this as ``tests.probes``. Real hivemind DHTs on loopback."""

from __future__ import annotations

import torch

# a tracker that reads the swarm's progress every 0.2-0.5 s, so a probe sees a step at once
FAST_TRACKER = dict(min_refresh_period=0.2, max_refresh_period=0.5, default_refresh_period=0.2)


def lone_optimizer(run_id: str, model: torch.nn.Module, *, lr: float, overlap: bool, target_batch_size: int,
                   batch_size_per_step: int = 4):
    """A lone peer's optimizer as the worker builds it (``swarm.build_optimizer``, AdamW at ``lr``)
    on a fresh DHT: ``(dht, optimizer)``."""
    from dedloc_core.engine import swarm

    class Recipe:
        build_scheduler = None

        @staticmethod
        def build_optimizer(params):
            return torch.optim.AdamW(params, lr=lr)

    swarm.prepare_process()
    cfg = swarm.SwarmConfig(run_id=run_id, target_batch_size=target_batch_size,
                            batch_size_per_step=batch_size_per_step, overlap=overlap,
                            matchmaking_time=0.5, averaging_timeout=5.0)
    dht = swarm.start_dht(cfg)
    return dht, swarm.build_optimizer(dht, cfg, model, Recipe)


def two_dhts():
    """Two connected DHTs on loopback, ``(ours, another peer's)``, with our patches installed."""
    import hivemind

    from dedloc_core.engine import hivemind_patches

    hivemind_patches.install()
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    other = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs())
    return first, other
