"""An averager leaves no socket behind.

Upstream: ``hivemind/averaging/averager.py``, ``DecentralizedAverager._shutdown`` (wrapped).

Without it: each averager talks to p2pd through a replica of the DHT's ``P2P``
(``DHT.replicate_p2p``), whose client listens on a unix socket
``/tmp/hivemind-p2pclient-*.sock``. ``_shutdown`` removes the averager's handlers but never shuts
the replica down, so its socket file stays in /tmp: two per worker session (a join, a rejoin,
the resume after a long pause), thousands on a machine after days of tests.

Fix: the replica is shut down after the handlers are gone (``P2P._terminate`` removes the file;
a replica has no daemon to stop).

Kind: bug fix (belongs upstream; docs/hivemind/replica_sockets.patch)

Shown: ``tests/test_replica_sockets.py`` (no socket file left after a session; two without this).
"""

from __future__ import annotations

REPLACES = ["hivemind.averaging.averager.DecentralizedAverager._shutdown"]


def install() -> None:
    from hivemind.averaging.averager import DecentralizedAverager

    shutdown = DecentralizedAverager._shutdown

    async def _shutdown(self, timeout) -> None:
        try:
            await shutdown(self, timeout)
        finally:
            replica = getattr(self, "_p2p", None)
            if replica is not None:
                await replica.shutdown()

    DecentralizedAverager._shutdown = _shutdown  # type: ignore[method-assign]
