"""No relay for strangers, and extra p2pd flags.

Upstream: ``hivemind/p2p/p2p_daemon.py``: ``P2P.create`` (wrapped: a handler added after it) and
``P2P._make_process_args`` (wrapped: flags added). The daemon side is p2pd's ``main.go``
(``d.EnableRelayV2()`` whenever ``-relay=1``).

Without it: p2pd offers a circuit relay (v2) to anyone, with default limits (up to 4 GiB and
30 min per circuit), in two ways. ``-relay=1`` enables the relay, and ``P2P.create`` offers only
``use_relay=False``, which also stops this peer from using relays. And once AutoNAT (through
other peers of the swarm) finds the host public, libp2p's relay manager starts a relay service
again and takes the hop protocol back: a public volunteer in a training swarm grants
reservations (the network lab, ``tests/test_netlab.py``).

Fix: after ``P2P.create`` we register our own handler for the relay's hop protocol
(``RELAY_HOP``); the daemon routes those streams to us instead of its relay, and we close them.
Every daemon of a peer that does not relay gets ``-relayService=0``, which stops the relay
manager. No reservations, no circuits. The backbone opts in with ``set_relay_service(True)``.
``set_p2pd_options`` appends extra p2pd flags (a NATed peer that names its relay sets
``relayDiscovery=False``; with few public peers, discovery finds none).

Kind: our policy

Shown: ``tests/test_reachability.py`` (p2pd's command line: without this a volunteer's daemon offers
the relay service) and ``tests/test_netlab.py`` (a public volunteer refuses to relay, the backbone
relays; needs the network lab, and has no run without this).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

REPLACES = [
    "hivemind.p2p.p2p_daemon.P2P.create",
    "hivemind.p2p.p2p_daemon.P2P._make_process_args",
]

RELAY_HOP = "/libp2p/circuit/relay/0.2.0/hop"
_relay_service = False  # module state is inherited by the forked DHT processes
_p2pd_flags: dict[str, Any] = {}


def set_relay_service(enabled: bool) -> None:
    """Whether P2P daemons started from now on relay for other peers (the backbone only)."""
    global _relay_service
    _relay_service = enabled


def relay_service() -> bool:
    return _relay_service


def set_p2pd_options(**flags: Any) -> None:
    """Extra p2pd flags for daemons started from now on, e.g. ``relayDiscovery=False``.
    ``None`` removes a flag. Set before creating the DHT: its process is forked and inherits them."""
    for key, value in flags.items():
        if value is None:
            _p2pd_flags.pop(key, None)
        else:
            _p2pd_flags[key] = value


def p2pd_options() -> dict[str, Any]:
    return dict(_p2pd_flags)


async def _refuse(info: Any, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    logging.getLogger(__name__).info("Refused to relay for %s", getattr(info, "peer_id", "a peer"))
    writer.close()


def install() -> None:
    from hivemind.p2p.p2p_daemon import P2P

    make_args = P2P._make_process_args

    def _make_process_args(*args: Any, **kwargs: Any) -> list[str]:
        relay = {} if _relay_service else {"relayService": False}
        return make_args(*args, **{**kwargs, **relay, **_p2pd_flags})

    P2P._make_process_args = staticmethod(_make_process_args)  # type: ignore[method-assign]

    create = P2P.create.__func__  # type: ignore[attr-defined]

    async def create_without_relay_service(cls, *args: Any, **kwargs: Any) -> P2P:
        p2p = await create(cls, *args, **kwargs)
        if not _relay_service:
            await p2p.add_binary_stream_handler(RELAY_HOP, _refuse)
        return p2p

    P2P.create = classmethod(create_without_relay_service)  # type: ignore[method-assign,assignment]
