"""Traffic counters: the bytes of every p2p message this peer sends and receives.

Upstream: ``hivemind/p2p/p2p_daemon.py``: ``P2P.send_raw_data`` and ``P2P.receive_raw_data``
(streams), ``P2P._call_unary_protobuf_handler`` and ``P2P._add_protobuf_unary_handler`` (unary
calls and their handlers), each wrapped.

Without it: hivemind counts nothing; the worker's ``stats`` events and ``bench/`` have no traffic
figures.

Fix: each wrapper adds its message's size to two counters in shared memory (``traffic()``), so the
forked averager processes add to the same totals. Installed after ``bandwidth_caps``: the counters
wrap the paced functions.

Kind: our policy

Shown: ``tests/test_bandwidth.py`` (the counters see a 3 MiB transfer both ways).
Not shown without: hivemind counts nothing, so there is no figure to compare with.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from typing import Any

REPLACES = [
    "hivemind.p2p.p2p_daemon.P2P.send_raw_data",
    "hivemind.p2p.p2p_daemon.P2P.receive_raw_data",
    "hivemind.p2p.p2p_daemon.P2P._call_unary_protobuf_handler",
    "hivemind.p2p.p2p_daemon.P2P._add_protobuf_unary_handler",
]

_counters: Any = None  # shared RawArray('Q', 2): [sent, received]


def _add(index: int, n: int) -> None:
    if _counters is not None:
        _counters[index] += n  # racy across processes by a few bytes at worst; fine for statistics


def traffic() -> tuple[int, int]:
    """(bytes sent, bytes received) by this peer's p2p streams and calls since ``install()``."""
    if _counters is None:
        return 0, 0
    return int(_counters[0]), int(_counters[1])


def install() -> None:
    global _counters
    from hivemind.p2p.p2p_daemon import P2P

    _counters = mp.RawArray("Q", 2)
    send_raw, receive_raw = P2P.send_raw_data, P2P.receive_raw_data

    async def send_raw_data(data: bytes, writer: asyncio.StreamWriter, *, chunk_size: int = 2**16) -> None:
        _add(0, len(data) + P2P.HEADER_LEN)
        await send_raw(data, writer, chunk_size=chunk_size)

    async def receive_raw_data(reader: asyncio.StreamReader) -> bytes:
        data = await receive_raw(reader)
        _add(1, len(data) + P2P.HEADER_LEN)
        return data

    P2P.send_raw_data = staticmethod(send_raw_data)  # type: ignore[method-assign]
    P2P.receive_raw_data = staticmethod(receive_raw_data)  # type: ignore[method-assign]

    call_unary = P2P._call_unary_protobuf_handler

    async def _call_unary_protobuf_handler(self, peer_id, handle_name, input, output_protobuf_type):
        _add(0, input.ByteSize())
        response = await call_unary(self, peer_id, handle_name, input, output_protobuf_type)
        _add(1, response.ByteSize())
        return response

    P2P._call_unary_protobuf_handler = _call_unary_protobuf_handler  # type: ignore[method-assign]

    add_unary = P2P._add_protobuf_unary_handler

    async def _add_protobuf_unary_handler(self, handle_name, handler, input_protobuf_type, balanced=False):
        async def counted(request, context):
            _add(1, request.ByteSize())
            response = await handler(request, context)
            _add(0, response.ByteSize())
            return response

        await add_unary(self, handle_name, counted, input_protobuf_type, balanced=balanced)

    P2P._add_protobuf_unary_handler = _add_protobuf_unary_handler  # type: ignore[method-assign]
