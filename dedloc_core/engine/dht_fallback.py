"""A volunteer that only uses the swarm's DHT (``volunteer_dht: "client"``) starts serving it when
no backbone answers: else, with the backbones down, its DHT requests would have nobody to go to,
no group would form and the swarm would stop averaging.

``DhtFallback`` pings the initial peers (the backbones) every ``period`` seconds from a thread.
Once none has answered for ``after`` seconds, it turns the DHT into a server in the DHT's
own process (``_Serve``: hivemind's ``DHTProtocol.create`` does the same for a server) and
introduces it to every peer p2pd is connected to (the volunteers it averaged with); those that
serve too add it to their routing tables, and it adds them. It keeps introducing itself while no
backbone answers, since other volunteers turn into servers at their own moment. It stays a server
for the rest of the session (what ``"server"`` volunteers always are).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from . import reachability

logger = logging.getLogger(__name__)


class DhtFallback:
    """``lost_since``: when the backbones went out of reach (None while they answer), if something
    else (``Watchdog``) pings them already; else this pings them itself. ``after``: seconds out of
    reach before serving: a capped or busy link delays pings past their timeout for a while (the
    capped peer of ``tests/test_bandwidth_netns.py`` lost two in a row while its rounds ran)."""

    def __init__(self, dht, initial_peers: list[str], period: float = 5.0, after: float = 30.0,
                 lost_since: Callable[[], float | None] | None = None):
        self.dht, self.peers, self.period, self.after = dht, list(initial_peers), period, after
        self.lost_since = lost_since
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dht-fallback", daemon=True)
        if self.peers:
            self._thread.start()

    def _run(self) -> None:
        own_since: float | None = None  # the first of our own pings in a row that nobody answered
        while not self._stop.wait(self.period):
            if self.lost_since is not None:
                since = self.lost_since()
            elif reachability.ping_initial_peers(self.dht, self.peers, timeout=self.period):
                since = own_since = None
            else:
                since = own_since = own_since or time.monotonic() - self.period
            if since is None or time.monotonic() - since < self.after:
                continue
            try:
                became, known = self.dht.run_coroutine(_Serve(timeout=self.period))
            except Exception as exc:  # the DHT is going away; the session ends it
                logger.debug("Could not serve the DHT: %r", exc)
                continue
            if became:
                logger.warning("No backbone answered for %.0f s: this peer serves the swarm's DHT now "
                               "(%d peers known)", time.monotonic() - since, known)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():  # a ping under way ends with the DHT's shutdown: do not wait it out
            self._thread.join(timeout=1.0)


class _Serve:
    """In the DHT's process: serve DHT requests, and ping each connected peer not in our routing
    table, so that those that serve add us (and we them). Returns (whether we became a server now,
    peers in the routing table)."""

    def __init__(self, timeout: float):
        self.timeout = timeout

    async def __call__(self, _dht, node) -> tuple[bool, int]:
        from hivemind.proto import dht_pb2
        from hivemind.utils.auth import AuthRole, AuthRPCWrapper

        protocol = node.protocol
        became = protocol.client_mode
        if became:
            await protocol.add_p2p_handlers(protocol.p2p, AuthRPCWrapper(protocol, AuthRole.SERVICER,
                                                                         protocol.authorizer))
            protocol.node_info = dht_pb2.NodeInfo(node_id=node.node_id.to_bytes())
            protocol.client_mode = False
        known = protocol.routing_table.peer_id_to_uid
        peers = [info.peer_id for info in await node.p2p.list_peers() if info.peer_id not in known]
        try:
            await asyncio.wait_for(asyncio.gather(*(protocol.call_ping(p) for p in peers), return_exceptions=True),
                                   self.timeout)
        except TimeoutError:
            pass
        return became, len(known)
