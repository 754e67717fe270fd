"""An optimizer's client_mode is the one it is given.

Upstream: ``hivemind/optim/optimizer.py``, ``Optimizer.__init__`` (wrapped; it relies on the line
that reads ``client_mode if client_mode is None else dht.client_mode``).

Without it: that line makes the optimizer's averagers always take the DHT's mode. A volunteer that
uses the DHT without serving it (``SwarmConfig.dht_client``) still takes averaging connections,
and one that serves the DHT cannot ask for client-mode averagers.

Fix: the optimizer is created with the DHT's ``client_mode`` read as the one given (restored
right after).

Kind: bug fix (belongs upstream; docs/hivemind/optimizer_client_mode.patch)

Shown: ``tests/test_hivemind_ext_guard.py`` (client-mode averagers on a serving DHT; without this they
take the DHT's mode) and ``tests/test_swarm.py`` (DHT clients still reduce for the swarm).
"""

from __future__ import annotations

import functools

REPLACES = ["hivemind.optim.optimizer.Optimizer.__init__"]


def install() -> None:
    from hivemind.optim.optimizer import Optimizer

    init = Optimizer.__init__

    @functools.wraps(init)
    def __init__(self, *args, dht, client_mode=None, **kwargs) -> None:
        if client_mode is None or client_mode == dht.client_mode:
            return init(self, *args, dht=dht, client_mode=client_mode, **kwargs)
        actual, dht._client_mode = dht.client_mode, client_mode
        try:
            init(self, *args, dht=dht, client_mode=client_mode, **kwargs)
        finally:
            dht._client_mode = actual

    Optimizer.__init__ = __init__  # type: ignore[method-assign]
