"""Can other peers reach this one? Joining the swarm directly, through the backbone's relay, or
outbound only, and finding the way back after the link went down.

How it decides (``join``): the peer starts its DHT as usual, then asks a backbone (any initial peer
that serves ``DIALBACK``) to dial back. The backbone opens a plain TCP connection to each address
the peer listens on, from its own side of the network; the existing libp2p connection cannot
answer that question, since it was opened by the peer. It dials only addresses on the IP that
peer's own connection comes from (a NATed peer's private addresses are not dialled: it is not
direct), and in an invite-only experiment only for a peer whose token it names. If one connection
succeeds the peer is **direct**. Otherwise it restarts its DHT with the backbone as its circuit relay (hivemind's
``use_relay``/``use_auto_relay`` with ``trusted_relays``) and waits for a ``/p2p-circuit``
address: **via relay** (if the reservation is lost later, say the backbone restarts or the link was
down, the worker reports **relay lost**: p2pd's autorelay drops a static relay on disconnection and
never asks it again, go-libp2p issue #1782; the training session then restarts, see
``training.Watchdog.relay_gone``). If none comes, it restarts in hivemind's client mode:
**outbound only**; it still sends and receives gradients over the connections it opens itself.

A peer whose addresses are all loopback (a local swarm, the tests on 127.0.0.1) is "direct" without
asking. Volunteers never relay for others (``hivemind_ext.relay_policy``); the backbone does.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from hivemind.utils.multiaddr import Multiaddr

logger = logging.getLogger(__name__)

DIRECT, VIA_RELAY, OUTBOUND_ONLY = "direct", "via relay", "outbound only"
RELAY_LOST = "relay lost"  # joined via relay, but the reservation is gone (p2pd does not renew it)
DIALBACK = "dedloc.dialback"
DIAL_TIMEOUT = 3.0
MAX_DIAL_ADDRS = 8


# ---- the backbone's side -------------------------------------------------------------------------

def serve_dialback(dht) -> None:
    """Answer dial-back requests on ``dht``'s p2p (runs in the DHT's event loop).

    In an invite-only experiment (``gate.active()`` in this process before the DHT starts) only a
    caller with a valid token for its own peer id gets an answer."""
    dht.run_coroutine(_add_dialback_handler)


async def _add_dialback_handler(_dht, node) -> None:
    from google.protobuf.wrappers_pb2 import StringValue

    async def handler(request, context):
        return await _dialback(node.p2p, request, context)

    await node.p2p.add_protobuf_handler(DIALBACK, handler, StringValue)


def _parse_request(value: str) -> tuple[list[str], str | None]:
    """(multiaddrs, token) of a request: a JSON list of multiaddrs, or ``{"maddrs": [...], "token": "..."}``."""
    try:
        body = json.loads(value)
    except ValueError:
        return [], None
    token = None
    if isinstance(body, dict):
        token = body.get("token") if isinstance(body.get("token"), str) else None
        body = body.get("maddrs")
    if not isinstance(body, list):
        return [], token
    return [str(m) for m in body][:MAX_DIAL_ADDRS], token


async def _observed_ips(p2p, peer_id) -> set:
    """The IP addresses this daemon's open connections to ``peer_id`` come from (relayed ones have none)."""
    ips = set()
    for info in await p2p.list_peers():
        if info.peer_id != peer_id:
            continue
        for addr in info.addrs:
            ip = _ip_of(str(addr))
            if ip is not None:
                ips.add(ip)
    return ips


async def _dialback(p2p, request, context):
    """Request: the caller's multiaddrs (and its invite token). Reply: JSON list of those we could
    connect to. Only plain TCP connects, no data sent, to at most ``MAX_DIAL_ADDRS`` addresses, and
    only on an IP address the caller's own connection to us comes from: a caller cannot make us
    probe anybody else's ports (a private range behind us, another host)."""
    from google.protobuf.wrappers_pb2 import StringValue

    from . import gate

    maddrs, token = _parse_request(request.value)
    if gate.active() and (token is None or gate.valid(token, context.remote_id.to_base58()) is None):
        logger.info("Dial-back refused to %s: no valid invite token", context.remote_id)
        return StringValue(value="[]")
    observed = await _observed_ips(p2p, context.remote_id)
    own = [m for m in maddrs if (endpoint := _tcp_endpoint(m)) and ipaddress.ip_address(endpoint[0]) in observed]
    results = await asyncio.gather(*(_can_connect(m) for m in own))
    reached = [m for m, ok in zip(own, results, strict=True) if ok]
    logger.info("Dial-back to %s: %d of %d addresses reached (%d not on its own IP %s)", context.remote_id,
                len(reached), len(maddrs), len(maddrs) - len(own), sorted(map(str, observed)) or "none")
    return StringValue(value=json.dumps(reached))


async def _can_connect(maddr: str) -> bool:
    host_port = _tcp_endpoint(maddr)
    if host_port is None:
        return False
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*host_port), DIAL_TIMEOUT)
    except (TimeoutError, OSError):
        return False
    writer.close()
    return True


def _ip_of(maddr: str):
    """The IP address of a direct ``/ip4|ip6/…`` multiaddr (an ``ipaddress`` object); None otherwise."""
    try:
        addr = Multiaddr(maddr)
        protocols = {p.name for p in addr.protocols()}
        if "p2p-circuit" in protocols:
            return None
        ip = addr.value_for_protocol("ip4") if "ip4" in protocols else addr.value_for_protocol("ip6")
        return ipaddress.ip_address(ip) if ip else None
    except Exception:  # any malformed address has none
        return None


def _tcp_endpoint(maddr: str) -> tuple[str, int] | None:
    """(ip, port) of a ``/ip4|ip6/…/tcp/…`` address that is not loopback; None otherwise."""
    ip = _ip_of(maddr)
    if ip is None or ip.is_loopback or ip.is_unspecified:
        return None
    try:
        addr = Multiaddr(maddr)
        if "tcp" not in {p.name for p in addr.protocols()}:
            return None
        return str(ip), int(addr.value_for_protocol("tcp"))
    except Exception:  # any malformed address is simply not dialled
        return None


# ---- the volunteer's side ------------------------------------------------------------------------

def ask_dialback(dht, helpers: list[str], timeout: float = 15.0, token: str | None = None) -> bool | None:
    """Whether a helper (an initial peer serving DIALBACK) could connect to us; None if none answered.
    ``token``: this peer's invite token (an invite-only experiment's backbone answers token holders only)."""
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    for helper in helpers:
        try:
            peer_id = Multiaddr(helper).value_for_protocol("p2p")
        except Exception:
            continue
        try:
            reached = dht.run_coroutine(_CallDialback(peer_id, maddrs, timeout, token))
        except Exception as exc:  # an old backbone without the handler, or a timeout
            logger.info("Dial-back via %s failed: %s", peer_id, exc)
            continue
        logger.info("Dial-back via %s reached %s", peer_id, reached or "nothing")
        return bool(reached)
    return None


class _CallDialback:
    """A picklable coroutine for ``DHT.run_coroutine`` (it runs in the DHT's event loop)."""

    def __init__(self, peer_id: str, maddrs: list[str], timeout: float, token: str | None = None):
        self.peer_id, self.maddrs, self.timeout, self.token = peer_id, maddrs, timeout, token

    async def __call__(self, _dht, node) -> list[str]:
        from google.protobuf.wrappers_pb2 import StringValue
        from hivemind.p2p import PeerID

        body = self.maddrs if self.token is None else {"maddrs": self.maddrs, "token": self.token}
        request = StringValue(value=json.dumps(body))
        call = node.p2p.call_protobuf_handler(PeerID.from_base58(self.peer_id), DIALBACK, request, StringValue)
        response = await asyncio.wait_for(call, self.timeout)
        return json.loads(response.value)


def only_loopback(maddrs: list[str]) -> bool:
    for maddr in maddrs:
        try:
            addr = Multiaddr(maddr)
            protocols = {p.name for p in addr.protocols()}
            ip = addr.value_for_protocol("ip4") if "ip4" in protocols else addr.value_for_protocol("ip6")
            if not ipaddress.ip_address(ip).is_loopback:
                return False
        except Exception:
            return False
    return True


def join(cfg, start_dht: Callable[..., Any], relay_wait: float = 10.0, relay_tries: int = 3,
         on_start: Callable[[Any], None] | None = None) -> tuple[Any, str]:
    """Start a DHT that others can use to reach us, as well as this network allows.

    ``cfg`` is a ``swarm.SwarmConfig``; ``cfg.reachability`` "auto" decides by dial-back, or forces
    "direct", "relay" or "outbound". ``on_start(dht)`` is called for each DHT as soon as it is up,
    before the dial-back (one that is shut down again is followed by another call). Returns (dht,
    one of DIRECT, VIA_RELAY, OUTBOUND_ONLY)."""
    if on_start is not None:
        start_dht = _calling(start_dht, on_start)
    mode = cfg.reachability
    if cfg.client_mode or mode == "outbound":
        return start_dht(cfg, client_mode=True), OUTBOUND_ONLY
    if mode == "auto":
        if not cfg.initial_peers or only_loopback(cfg.host_maddrs):
            return start_dht(cfg), DIRECT
        dht = start_dht(cfg)
        if ask_dialback(dht, cfg.initial_peers, token=_own_token(cfg)) is not False:
            return dht, DIRECT
        dht.shutdown()
    elif mode == "direct":
        return start_dht(cfg), DIRECT
    # not reachable: a reservation on the backbone's relay, else outbound only. A reservation comes
    # within a second or two, or not at all from that daemon (seen under load): a fresh daemon retries.
    for attempt in range(1, relay_tries + 1):
        try:
            dht = _start_relayed(cfg, start_dht)
        except Exception as exc:  # seen once: "failed to connect to bootstrap peers"
            logger.warning("A relayed daemon did not start (try %d of %d): %s", attempt, relay_tries, exc)
            time.sleep(1.0)
            continue
        if _wait_for_relay_address(dht, relay_wait):
            return dht, VIA_RELAY
        logger.warning("No relay address after %.0f s (try %d of %d)", relay_wait, attempt, relay_tries)
        dht.shutdown()
    logger.warning("No relay reservation; joining outbound only (client mode)")
    return start_dht(cfg, client_mode=True, check_if_identity_free=False), OUTBOUND_ONLY


def _own_token(cfg) -> str | None:
    """This peer's invite token (an invite-only experiment's ``gate.InviteAuthorizer``), else None."""
    holder = getattr(cfg.authorizer, "holder", None)
    return holder.get() if holder is not None else None


def _calling(start_dht: Callable[..., Any], on_start: Callable[[Any], None]) -> Callable[..., Any]:
    def started(*args, **kwargs):
        dht = start_dht(*args, **kwargs)
        on_start(dht)
        return dht
    return started


def _start_relayed(cfg, start_dht: Callable[..., Any]):
    from . import hivemind_ext

    hivemind_ext.set_p2pd_options(relayDiscovery=False)
    try:
        return start_dht(cfg, use_relay=True, use_auto_relay=True, trusted_relays=cfg.initial_peers,
                         force_reachability="private",  # do not wait for AutoNAT to find out
                         check_if_identity_free=False)  # hivemind's check starts a p2pd that rejects autorelay
    finally:
        hivemind_ext.set_p2pd_options(relayDiscovery=None)


def _wait_for_relay_address(dht, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any("p2p-circuit" in str(m) for m in dht.get_visible_maddrs(latest=True)):
            return True
        time.sleep(0.5)
    return False


# ---- finding the way back -------------------------------------------------------------------------

def ping_initial_peers(dht, initial_peers: list[str], timeout: float = 5.0) -> int:
    """Ping the initial peers; each that answers is (re)added to the routing table. A peer whose link
    was down finds the swarm again this way. Returns how many answered."""
    ids = []
    for maddr in initial_peers:
        try:
            ids.append(Multiaddr(maddr).value_for_protocol("p2p"))
        except Exception:
            continue
    if not ids:
        return 0
    try:
        return dht.run_coroutine(_Ping(ids, timeout))
    except Exception:
        return 0


class _Ping:
    def __init__(self, peer_ids: list[str], timeout: float):
        self.peer_ids, self.timeout = peer_ids, timeout

    async def __call__(self, _dht, node) -> int:
        from hivemind.p2p import PeerID

        pings = [node.protocol.call_ping(PeerID.from_base58(p)) for p in self.peer_ids]
        try:
            results = await asyncio.wait_for(asyncio.gather(*pings, return_exceptions=True), self.timeout)
        except TimeoutError:
            return 0
        return sum(1 for r in results if r is not None and not isinstance(r, BaseException))
