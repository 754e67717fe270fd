"""The backbone's circuit relay in an invite-only experiment: for members only.

p2pd's relay (circuit relay v2) serves anyone and has no hook to refuse a peer. So in an invite-only
experiment the backbone's daemon runs without its relay service (``hivemind_ext.relay_policy``) and
``serve(dht)`` registers this relay for the hop protocol (``RELAY_HOP``) in the DHT's process:

- RESERVE from a member (a valid token in the DHT's invite registry, not revoked: ``gate.admits``)
  is answered OK with a reservation for ``RESERVATION_S``; from anyone else PERMISSION_DENIED,
  after ``RESERVE_WAIT_S`` (a newcomer's daemon asks as it starts, while its token is being published).
- CONNECT from a member to a peer holding a reservation (and still a member) opens a stream to it
  with the stop protocol (``RELAY_STOP``), hands over the source's peer id, and once the target says
  OK splices the two streams, for at most ``CIRCUIT_S`` seconds and ``CIRCUIT_BYTES`` each way.
  A stranger, or a target without a reservation, is refused and the stream closed.

The messages are circuit v2's ``HopMessage`` and ``StopMessage`` (go-libp2p's
``p2p/protocol/circuitv2/pb/circuit.proto``), varint length-prefixed; ``encode`` and ``decode``
handle the few fields used. The replies carry no limit, so the peers' libp2p treats a circuit as an
ordinary connection (with one, it marks it transient). Open experiments keep p2pd's own relay.

Kind: our policy (p2pd's relay has no access control). Shown: ``tests/test_member_relay.py`` (slow:
a real backbone; strangers get reservations and reach each other through an open one, not through an
invite-only one, where members do; in the network lab a NATed member gets its ``/p2p-circuit`` address).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable

from .hivemind_ext import RELAY_HOP

logger = logging.getLogger(__name__)

RELAY_STOP = "/libp2p/circuit/relay/0.2.0/stop"
RESERVATION_S = 600  # a reservation's lifetime; clients renew theirs before it ends, and are checked again
RESERVE_WAIT_S = 5.0  # how long a RESERVE from a peer not (yet) a member waits for its token
CIRCUIT_S = 30 * 60  # a circuit's longest life (p2pd's default)
CIRCUIT_BYTES = 1 << 30  # bytes relayed each way before a circuit is cut
MAX_CIRCUITS_PER_PEER = 16
MAX_RESERVATIONS = 1024
MAX_MESSAGE = 4096
STEP_TIMEOUT = 20.0  # seconds for each message of the handshake
CHUNK = 64 * 1024

# HopMessage.Type, StopMessage.Type and Status
RESERVE, CONNECT, STATUS = 0, 1, 2
STOP_CONNECT, STOP_STATUS = 0, 1
OK, RESOURCE_LIMIT_EXCEEDED, PERMISSION_DENIED, CONNECTION_FAILED, NO_RESERVATION = 100, 201, 202, 203, 204
MALFORMED_MESSAGE, UNEXPECTED_MESSAGE = 400, 401


class MemberRelay:
    """The hop protocol's handler (``handle``) on ``p2p``; ``admits(peer_id)`` says who is a member
    (``gate.admits``); ``addrs``: this relay's multiaddrs (bytes), sent with a reservation."""

    def __init__(self, p2p, admits: Callable[[str], Awaitable[bool]], addrs: list[bytes]):
        self.p2p, self.admits, self.addrs = p2p, admits, addrs
        self.reservations: dict[str, float] = {}  # peer id -> until when (time.time())
        self.circuits: Counter[str] = Counter()  # peer id -> circuits open, as source or target
        self.relayed = 0  # circuits opened so far

    async def handle(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = info.peer_id.to_base58()
        try:
            msg = await asyncio.wait_for(read_message(reader), STEP_TIMEOUT)
            kind = int_field(msg, 1)
            if kind == RESERVE:
                await self._reserve(peer, writer)
            elif kind == CONNECT:
                await self._connect(info.peer_id, msg, reader, writer)
            else:
                await _status(writer, UNEXPECTED_MESSAGE)
        except (ValueError, asyncio.IncompleteReadError):
            await _status(writer, MALFORMED_MESSAGE)
        except (TimeoutError, ConnectionError) as exc:
            logger.debug("Relay stream of %s ended: %r", peer, exc)
        finally:
            writer.close()

    async def _member(self, peer: str, wait: float = 0.0) -> bool:
        """Whether ``peer`` is a member, asking again each second for up to ``wait`` seconds."""
        deadline = time.monotonic() + wait
        while not await self.admits(peer):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(1.0)
        return True

    async def _reserve(self, peer: str, writer: asyncio.StreamWriter) -> None:
        if not await self._member(peer, RESERVE_WAIT_S):
            logger.info("Relay reservation refused to %s: not a member", peer)
            await _status(writer, PERMISSION_DENIED)
            return
        now = time.time()
        for other in [p for p, until in self.reservations.items() if until <= now]:
            del self.reservations[other]
        if peer not in self.reservations and len(self.reservations) >= MAX_RESERVATIONS:
            await _status(writer, RESOURCE_LIMIT_EXCEEDED)
            return
        expire = int(now) + RESERVATION_S
        self.reservations[peer] = expire
        reservation = encode((1, expire), *((2, addr) for addr in self.addrs))
        await write_message(writer, encode((1, STATUS), (3, reservation), (5, OK)))
        logger.info("Relay reservation for member %s until %s", peer, time.strftime("%H:%M:%S", time.localtime(expire)))

    async def _connect(self, source, msg: dict, reader, writer) -> None:
        from hivemind.p2p import PeerID

        target_id = bytes_field(decode(bytes_field(msg, 2)), 1)
        target, src = PeerID(target_id), source.to_base58()
        dst = target.to_base58()
        if not await self._member(src):
            logger.info("Relay circuit refused to %s (to %s): not a member", src, dst)
            await _status(writer, PERMISSION_DENIED)
            return
        if self.reservations.get(dst, 0.0) <= time.time() or not await self._member(dst):
            await _status(writer, NO_RESERVATION)
            return
        if max(self.circuits[src], self.circuits[dst]) >= MAX_CIRCUITS_PER_PEER:
            await _status(writer, RESOURCE_LIMIT_EXCEEDED)
            return
        self.circuits.update((src, dst))
        try:
            stop = await self._open_stop(target, source)
            if stop is None:
                await _status(writer, CONNECTION_FAILED)
                return
            stop_reader, stop_writer = stop
            try:
                await _status(writer, OK)
                self.relayed += 1
                logger.info("Relay circuit %s -> %s open", src, dst)
                await _splice(reader, writer, stop_reader, stop_writer)
            finally:
                stop_writer.close()
        finally:
            self.circuits.subtract((src, dst))
            for peer in (src, dst):
                if self.circuits[peer] <= 0:
                    del self.circuits[peer]

    async def _open_stop(self, target, source):
        """A stop stream to ``target`` that accepted a circuit from ``source``: (reader, writer), or None."""
        try:
            _, stop_reader, stop_writer = await asyncio.wait_for(
                self.p2p.call_binary_stream_handler(target, RELAY_STOP), STEP_TIMEOUT)
        except Exception as exc:  # not connected, or gone
            logger.info("Relay circuit to %s failed: %s", target, exc)
            return None
        try:
            await write_message(stop_writer, encode((1, STOP_CONNECT), (2, encode((1, source.to_bytes())))))
            answer = await asyncio.wait_for(read_message(stop_reader), STEP_TIMEOUT)
            if int_field(answer, 1) == STOP_STATUS and int_field(answer, 4) == OK:
                return stop_reader, stop_writer
            logger.info("Relay circuit to %s refused by it (status %s)", target, int_field(answer, 4))
        except (ValueError, TimeoutError, ConnectionError, asyncio.IncompleteReadError) as exc:
            logger.info("Relay circuit to %s failed: %r", target, exc)
        stop_writer.close()
        return None


def serve(dht) -> None:
    """Relay for members only on ``dht``'s daemon (call in the main process once the DHT runs, with
    ``gate.configure`` done before the DHT started, and p2pd's relay service off)."""
    from . import gate, hivemind_ext

    if not gate.active():
        raise ValueError("member_relay.serve: the gate is off (gate.configure before starting the DHT)")
    if hivemind_ext.relay_service():
        raise ValueError("member_relay.serve: p2pd's own relay is on (start the DHT with relay_service=False)")
    dht.run_coroutine(_Serve())


class _Serve:
    """Runs in the DHT's process: registers a ``MemberRelay`` on its P2P."""

    async def __call__(self, dht, node) -> None:
        from . import gate

        registry = _Registry(node)
        addrs = [m.to_bytes() for m in await node.p2p.get_visible_maddrs()]
        relay = MemberRelay(node.p2p, lambda peer: gate.admits(registry, peer), addrs)
        await node.p2p.remove_binary_stream_handler(RELAY_HOP)  # relay_policy's, which refuses everyone
        await node.p2p.add_binary_stream_handler(RELAY_HOP, relay.handle)
        dht.member_relay = relay  # lives as long as the DHT
        logger.info("Relaying for members only")


class _Registry:
    """``gate.admits`` reads the invite registry through this: the DHT node itself, in its process."""

    def __init__(self, node):
        self.node = node

    async def get(self, key, latest: bool = False, return_future: bool = False):
        return await self.node.get(key, latest=latest)


async def _splice(reader_a, writer_a, reader_b, writer_b) -> None:
    """Copy both ways until one side ends, ``CIRCUIT_S`` passes or ``CIRCUIT_BYTES`` go one way."""
    pumps = [asyncio.create_task(_pump(reader_a, writer_b)), asyncio.create_task(_pump(reader_b, writer_a))]
    try:
        await asyncio.wait(pumps, timeout=CIRCUIT_S, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    left = CIRCUIT_BYTES
    while left > 0:
        data = await reader.read(min(CHUNK, left))
        if not data:
            return
        writer.write(data)
        await writer.drain()
        left -= len(data)


# ---- the wire: varint length-prefixed protobuf messages -----------------------------------------

async def read_message(reader: asyncio.StreamReader) -> dict[int, list]:
    """One length-prefixed message, decoded: field number -> values (ints or bytes)."""
    size = shift = 0
    while True:
        byte = (await reader.readexactly(1))[0]
        size |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
        if shift > 28:
            raise ValueError("length prefix too long")
    if size > MAX_MESSAGE:
        raise ValueError(f"message of {size} bytes")
    return decode(await reader.readexactly(size))


async def write_message(writer: asyncio.StreamWriter, message: bytes) -> None:
    writer.write(_varint(len(message)) + message)
    await writer.drain()


async def _status(writer: asyncio.StreamWriter, status: int) -> None:
    try:
        await write_message(writer, encode((1, STATUS), (5, status)))
    except ConnectionError:
        pass


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def encode(*fields: tuple[int, int | bytes]) -> bytes:
    """Fields (number, int or bytes) in protobuf's wire format: ints as varints, bytes length-delimited."""
    out = bytearray()
    for number, value in fields:
        if isinstance(value, int):
            out += _varint(number << 3) + _varint(value)
        else:
            out += _varint(number << 3 | 2) + _varint(len(value)) + value
    return bytes(out)


def decode(data: bytes) -> dict[int, list]:
    """Protobuf's wire format: field number -> values (varints as ints, length-delimited as bytes;
    fixed-width fields skipped). Raises ValueError on malformed input."""
    fields: dict[int, list] = {}
    pos = 0

    def varint() -> int:
        nonlocal pos
        value = shift = 0
        while True:
            if pos >= len(data) or shift > 63:
                raise ValueError("truncated varint")
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    while pos < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            fields.setdefault(number, []).append(varint())
        elif wire == 2:
            size = varint()
            if pos + size > len(data):
                raise ValueError("truncated field")
            fields.setdefault(number, []).append(data[pos:pos + size])
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"wire type {wire}")
    return fields


def int_field(fields: dict[int, list], number: int) -> int:
    """The field's last int, or 0 (proto3 leaves zeros out: an empty HopMessage is a RESERVE)."""
    values = [v for v in fields.get(number, []) if isinstance(v, int)]
    return values[-1] if values else 0


def bytes_field(fields: dict[int, list], number: int) -> bytes:
    values = [v for v in fields.get(number, []) if isinstance(v, bytes)]
    if not values:
        raise ValueError(f"field {number} missing")
    return values[-1]
