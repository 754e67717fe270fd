"""Bandwidth caps: the shared token bucket (arithmetic, across forked processes), and a real
transfer between two hivemind P2P peers (two p2pd daemons on loopback) with the upload or the
download capped, against the same transfer uncapped."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

import pytest

from dedloc_core.engine import bandwidth, hivemind_patches


@pytest.fixture
def caps():
    bandwidth.setup()
    yield bandwidth.set_caps
    bandwidth.set_caps(0, 0)


def test_bucket_lends_then_makes_takers_wait(caps):
    caps(100_000, 0)
    now = time.monotonic()
    burst = bandwidth._burst(100_000)  # 65536: one chunk
    assert bandwidth.reserve(bandwidth.UP, int(burst), now) == 0.0  # the burst goes at once
    assert bandwidth.reserve(bandwidth.UP, 50_000, now) == pytest.approx(0.5)  # in debt: wait
    assert bandwidth.reserve(bandwidth.UP, 50_000, now) == pytest.approx(1.0)  # queued behind it
    assert bandwidth.reserve(bandwidth.UP, 10_000, now + 1.0) == pytest.approx(0.1)  # debt paid: behind it
    assert bandwidth.reserve(bandwidth.UP, 10_000, now + 9.0) == 0.0  # refilled (to the burst) meanwhile
    assert bandwidth.reserve(bandwidth.DOWN, 10**9, now) == 0.0  # no download cap


def test_no_cap_means_no_wait_and_caps_change(caps):
    caps(0, 0)
    assert bandwidth.reserve(bandwidth.UP, 10**9) == 0.0
    assert not bandwidth.active(bandwidth.UP)
    caps(1000, 2000)
    assert bandwidth.caps() == (1000, 2000)
    caps(None, 0)  # None: unchanged
    assert bandwidth.caps() == (1000, 0)


def _take_in_child(n: int, out) -> None:
    began = time.monotonic()
    asyncio.run(bandwidth.take_up(n))
    out.put(time.monotonic() - began)


def test_forked_processes_share_the_budget(caps):
    caps(200_000, 0)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    children = [ctx.Process(target=_take_in_child, args=(200_000, out)) for _ in range(2)]
    began = time.monotonic()
    for child in children:
        child.start()
    for child in children:
        child.join(30)
    total = time.monotonic() - began
    waits = sorted(out.get(timeout=5) for _ in children)
    # 400 kB at 200 kB/s with a 65 kB burst: the last taker finishes after about 1.7 s
    assert waits[-1] >= 1.4, waits
    assert total < 10


# ---- two real peers ---------------------------------------------------------------------------

PART = 256 * 1024
PARTS = 12  # 3 MiB


async def _transfer() -> tuple[float, int]:
    from hivemind.p2p import P2P
    from hivemind.proto import runtime_pb2

    async def sink(requests, context):
        total = 0
        async for request in requests:
            total += len(request.buffer)
        yield runtime_pb2.Tensor(size=[total])

    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = await P2P.create(initial_peers=await server.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        await server.add_protobuf_handler("sink", sink, runtime_pb2.Tensor, stream_input=True, stream_output=True)

        async def parts():
            for _ in range(PARTS):
                yield runtime_pb2.Tensor(buffer=bytes(PART))

        began = time.monotonic()
        stream = await client.iterate_protobuf_handler(server.peer_id, "sink", parts(), runtime_pb2.Tensor)
        reply = [r async for r in stream]
        return time.monotonic() - began, reply[0].size[0]
    finally:
        await client.shutdown()
        await server.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("direction", ["upload", "download"])
def test_real_transfer_is_capped(caps, direction):
    hivemind_patches.install()
    caps(0, 0)
    fast, size = asyncio.run(_transfer())
    assert size == PART * PARTS
    cap = 1_000_000  # bytes/s: 3 MiB take at least ~3.1 s
    caps(cap, 0) if direction == "upload" else caps(0, cap)
    sent0, received0 = hivemind_patches.traffic()
    slow, size = asyncio.run(_transfer())
    sent1, received1 = hivemind_patches.traffic()
    assert size == PART * PARTS
    expected = PART * PARTS / cap
    assert expected * 0.9 <= slow <= expected * 3 + 5, (slow, expected)
    assert fast < slow / 2, (fast, slow)
    # both peers live in this process: the counters saw the bytes both ways
    assert sent1 - sent0 >= PART * PARTS and received1 - received0 >= PART * PARTS
