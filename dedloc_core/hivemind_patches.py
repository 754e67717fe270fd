"""Our named fixes and hooks on hivemind 1.1.12. Each patch says what it changes and why.

Call ``install()`` once in a process, before creating a DHT. Patches:

1. ``traffic``: counts the bytes of every p2p message this peer sends and receives
   (``P2P.send_raw_data`` / ``P2P.receive_raw_data`` for streams, ``P2P._call_unary_protobuf_handler``
   and ``P2P._add_protobuf_unary_handler`` for unary calls). hivemind counts nothing. The counters
   live in shared memory so the forked averager and DHT processes add to the same totals.
2. ``children die with us``: hivemind forks its DHT and averager processes and starts ``p2pd``
   (``p2p/p2p_daemon.py``, ``create_subprocess_exec``) without tying their lifetime to ours; after
   a SIGKILL they linger forever. We set ``PR_SET_PDEATHSIG`` = SIGKILL in every forked child and in
   ``p2pd``, so a killed worker takes its whole tree with it.
3. ``bandwidth caps``: hivemind cannot cap traffic (its ``bandwidth`` is a load-balancing hint).
   We pace ``P2P.send_protobuf`` (each message waits for its tokens, then is written whole, as
   before) and ``P2P.receive_raw_data`` (read chunk by chunk, each after its tokens; ``p2p/p2p_daemon.py``)
   through the shared token buckets of ``dedloc_core.bandwidth``, and the unary calls and handlers
   per message. Installed before patch 1, so the counters wrap the paced functions. With no cap
   set, the original functions run unchanged.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
import os
import signal
import sys
from typing import Any

_installed = False
_counters: Any = None  # shared RawArray('Q', 2): [sent, received]
_PR_SET_PDEATHSIG = 1


def _set_pdeathsig() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except OSError:
            pass


def _add(index: int, n: int) -> None:
    if _counters is not None:
        _counters[index] += n  # racy across processes by a few bytes at worst; fine for statistics


def traffic() -> tuple[int, int]:
    """(bytes sent, bytes received) by this peer's p2p streams and calls since ``install()``."""
    if _counters is None:
        return 0, 0
    return int(_counters[0]), int(_counters[1])


def install() -> None:
    """Apply all patches (idempotent)."""
    global _installed, _counters
    if _installed:
        return
    _installed = True
    _counters = mp.RawArray("Q", 2)
    os.register_at_fork(after_in_child=_set_pdeathsig)
    _patch_bandwidth()
    _patch_traffic()
    _patch_p2pd_spawn()


def _patch_traffic() -> None:
    from hivemind.p2p import p2p_daemon
    from hivemind.p2p.p2p_daemon import P2P

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
    assert p2p_daemon.P2P is P2P


def _patch_p2pd_spawn() -> None:
    from hivemind.p2p import p2p_daemon

    real_asyncio = p2p_daemon.asyncio

    class _Subprocess:
        """Stands in for ``asyncio.subprocess`` inside p2p_daemon only."""

        PIPE = real_asyncio.subprocess.PIPE
        STDOUT = real_asyncio.subprocess.STDOUT

        @staticmethod
        async def create_subprocess_exec(*args, **kwargs):
            kwargs.setdefault("preexec_fn", _set_pdeathsig)
            return await real_asyncio.subprocess.create_subprocess_exec(*args, **kwargs)

    class _AsyncioProxy:
        subprocess = _Subprocess

        def __getattr__(self, name: str) -> Any:
            return getattr(real_asyncio, name)

    p2p_daemon.asyncio = _AsyncioProxy()  # type: ignore[assignment]


def _patch_bandwidth() -> None:
    from hivemind.p2p.p2p_daemon import P2P

    from . import bandwidth

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
