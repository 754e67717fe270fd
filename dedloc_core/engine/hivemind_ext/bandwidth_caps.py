"""Bandwidth caps: upload and download caps enforced on the wire.

Upstream: ``hivemind/p2p/p2p_daemon.py``: ``P2P.send_protobuf`` (wrapped),
``P2P.receive_raw_data`` (replaced whole while a download cap is set),
``P2P._call_unary_protobuf_handler`` and ``P2P._add_protobuf_unary_handler`` (wrapped).

Without it: hivemind cannot cap traffic (its ``bandwidth`` is a hint to the load-balancing LP),
and neither can p2pd; a volunteer's upload and download caps would not hold.

Fix: each message waits for its tokens from the shared buckets of ``dedloc_core.engine.bandwidth``
before it is written whole (as before), a stream is read chunk by chunk, each chunk after its
tokens (reading slower fills the buffers: the sender slows down), and unary calls and handlers
are paced per message. With no cap set, the original functions run unchanged.

Kind: our policy

Shown: ``tests/test_bandwidth.py`` (a 3 MiB transfer under a 1 MB/s cap takes its time, uncapped
it is fast).
"""

from __future__ import annotations

import asyncio

REPLACES = [
    "hivemind.p2p.p2p_daemon.P2P.send_protobuf",
    "hivemind.p2p.p2p_daemon.P2P.receive_raw_data",
    "hivemind.p2p.p2p_daemon.P2P._call_unary_protobuf_handler",
    "hivemind.p2p.p2p_daemon.P2P._add_protobuf_unary_handler",
]


def install() -> None:
    from hivemind.p2p.p2p_daemon import P2P

    from dedloc_core.engine import bandwidth

    bandwidth.setup()  # shared buckets, created before hivemind forks
    send_protobuf, receive_raw = P2P.send_protobuf, P2P.receive_raw_data

    async def send_protobuf_paced(protobuf, writer: asyncio.StreamWriter) -> None:
        # wait for the whole message's tokens (paced chunk by chunk) *before* writing any of it:
        # hivemind writes a message's marker, header and body with no yield between them, and a
        # yield there would let another coroutine's message interleave on the same stream
        if bandwidth.active(bandwidth.UP):
            await bandwidth.take_up(1 + P2P.HEADER_LEN + protobuf.ByteSize())
        await send_protobuf(protobuf, writer)

    async def receive_raw_data(reader: asyncio.StreamReader) -> bytes:
        if not bandwidth.active(bandwidth.DOWN):
            return await receive_raw(reader)
        header = await reader.readexactly(P2P.HEADER_LEN)
        left = int.from_bytes(header, P2P.BYTEORDER)
        parts = []
        while left > 0:
            step = min(left, bandwidth.CHUNK)
            await bandwidth.take_down(step)  # reading slower fills the buffers: the sender slows
            parts.append(await reader.readexactly(step))
            left -= step
        return b"".join(parts)

    P2P.send_protobuf = staticmethod(send_protobuf_paced)  # type: ignore[method-assign]
    P2P.receive_raw_data = staticmethod(receive_raw_data)  # type: ignore[method-assign]

    call_unary = P2P._call_unary_protobuf_handler

    async def _call_unary_protobuf_handler(self, peer_id, handle_name, input, output_protobuf_type):
        await bandwidth.take_up(input.ByteSize())
        response = await call_unary(self, peer_id, handle_name, input, output_protobuf_type)
        await bandwidth.take_down(response.ByteSize())
        return response

    P2P._call_unary_protobuf_handler = _call_unary_protobuf_handler  # type: ignore[method-assign]

    add_unary = P2P._add_protobuf_unary_handler

    async def _add_protobuf_unary_handler(self, handle_name, handler, input_protobuf_type, balanced=False):
        async def paced(request, context):
            await bandwidth.take_down(request.ByteSize())
            response = await handler(request, context)
            await bandwidth.take_up(response.ByteSize())
            return response

        await add_unary(self, handle_name, paced, input_protobuf_type, balanced=balanced)

    P2P._add_protobuf_unary_handler = _add_protobuf_unary_handler  # type: ignore[method-assign]
