"""hivemind_ext.stream_end: a stream handler closes only after its caller has read every answer.

p2pd resets a stream whose handler closed first, and that reset can drop answers still in flight
(``bench/stream_cut.py`` counts the cuts under load; too rare to show in a test). What the fix
changes is the order of the closes, shown here with two real P2P peers on loopback: with it, the
handler's stream outlives its last answer until the caller closes; without it, the handler closes
at once. A caller or handler of unchanged hivemind still gets every answer from a changed one.
"""

from __future__ import annotations

import pytest
from probes import probe_json

pytestmark = pytest.mark.slow  # starts hivemind peers

PROBE = """
import asyncio, json, sys, time
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2
from dedloc_core.engine import hivemind_ext

N, HOLD = 4, 0.5
mode, caller, handler = sys.argv[1:4]  # extensions to skip ("all": none); "old" or "new" for each side
old_iterate = P2P._iterate_protobuf_stream_handler

async def main():
    server = await P2P.create()
    client = await P2P.create(initial_peers=await server.get_visible_maddrs())
    closed = []
    add_binary = P2P.add_binary_stream_handler

    async def add_timed(self, name, handle, balanced=False):
        async def timed(*args):
            try:
                await handle(*args)
            finally:
                closed.append(time.monotonic())
        await add_binary(self, name, timed, balanced=balanced)

    P2P.add_binary_stream_handler = add_timed

    async def answers(stream, context):
        async for request in stream:
            yield averaging_pb2.AveragingData(group_id=request.group_id * 100_000)

    async def requests():
        for i in range(N):
            yield averaging_pb2.AveragingData(group_id=bytes([i]))

    if handler == "new":  # the handler's code is taken when it is added
        hivemind_ext.install(skip=() if mode == "all" else mode.split(","))
    await server.add_protobuf_handler("answers", answers, averaging_pb2.AveragingData, stream_input=True,
                                      stream_output=True)
    hivemind_ext.install(skip=() if mode == "all" else mode.split(","))
    iterate = old_iterate if caller == "old" else P2P._iterate_protobuf_stream_handler
    stream = await iterate(client, server.peer_id, "answers", requests(), averaging_pb2.AveragingData)
    got = [len((await stream.__anext__()).group_id) for _ in range(N)]
    read = time.monotonic()
    await asyncio.sleep(HOLD)  # the caller holds the stream open, answers read, its end not yet
    more = [response async for response in stream]
    ended = time.monotonic()
    await asyncio.sleep(0.2)
    print(json.dumps({"got": got, "more": len(more), "closed_after_read": round(closed[0] - read, 3),
                      "closed_before_caller": round(closed[0] - ended, 3)}))
    await client.shutdown()
    await server.shutdown()

asyncio.run(main())
"""


def probe(mode: str, caller: str = "new", handler: str = "new") -> dict:
    return probe_json(PROBE, mode, caller, handler)


def test_a_handler_closes_only_after_its_caller_has_read_the_end():
    result = probe("all")
    assert result["got"] == [100_000] * 4 and result["more"] == 0
    assert result["closed_after_read"] >= 0.45  # it waited while the caller held the stream
    assert result["closed_before_caller"] >= 0  # and closed once the caller had read the end


def test_without_it_the_handler_closes_right_after_its_last_answer():
    result = probe("stream_end")
    assert result["got"] == [100_000] * 4 and result["more"] == 0
    assert result["closed_after_read"] < 0.3  # closed under the caller's feet: the reset can cut answers


@pytest.mark.parametrize("caller, handler", [("old", "new"), ("new", "old")])
def test_unchanged_hivemind_on_either_side_still_gets_every_answer(caller, handler):
    result = probe("all", caller, handler)
    assert result["got"] == [100_000] * 4 and result["more"] == 0
    assert result["closed_after_read"] < 0.3  # no end was asked for or understood: upstream's order
