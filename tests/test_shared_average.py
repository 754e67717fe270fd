"""A sender that leaves while it waits for its average does not take the average from the others
(hivemind_ext.robust_reduce), with real hivemind averagers on loopback.

Every sender's handler at a reducer awaits the same future for a part's average. A handler is
cancelled when its caller leaves (a sender that timed out waiting, or died), and a cancelled
awaiter cancels the future it awaits: without the shield the average is lost for every sender,
and the reducer's own step never returns (its own part's task ends cancelled and the runner
waits for that output for ever, holding the averager's tensors)."""

from __future__ import annotations

import pytest
from probes import probe_json

# Three peers, one part to average (the vector is smaller than hivemind's part size): one peer
# reduces it, the other two only send. The first of those sends 4 s late; the second gives up on
# its average after 1 s and leaves, while the reducer still waits for the late one.
LEAVER = """
import json, sys, asyncio
import torch, hivemind
from hivemind.averaging import allreduce
if sys.argv[1] == "patched":
    from dedloc_core.engine import hivemind_ext
    hivemind_ext.install()
first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
dhts = [first] + [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                               initial_peers=[str(a) for a in first.get_visible_maddrs()]) for _ in range(2)]
generate = allreduce.AllReduceRunner._generate_input_for_peer
communicate = allreduce.AllReduceRunner._communicate_with_peer

def senders(self):
    parts = self.tensor_part_container.num_parts_by_peer
    return [peer for peer, n in zip(self.ordered_peer_ids, parts) if n == 0]

async def late(self, peer_index):
    if self.peer_id == senders(self)[0]:
        await asyncio.sleep(4.0)
    async for message in generate(self, peer_index):
        yield message

async def impatient(self, peer_id):
    if self.peer_id == senders(self)[1]:
        self.reducer_timeout = 1.0
    await communicate(self, peer_id)

allreduce.AllReduceRunner._generate_input_for_peer = late
allreduce.AllReduceRunner._communicate_with_peer = impatient
values = [torch.full((100_000,), float(v)) for v in (1.0, 2.0, 3.0)]
averagers = [hivemind.averaging.DecentralizedAverager(
    [v.clone()], dht=d, prefix="leaver", target_group_size=3, min_matchmaking_time=3.0, request_timeout=1.0,
    next_chunk_timeout=10.0, reducer_timeout=20.0, start=True) for v, d in zip(values, dhts)]
futures = [a.step(wait=False, timeout=20, allow_retries=False) for a in averagers]
outcome = []
for f in futures:
    try:
        outcome.append(len(f.result(timeout=40)))
    except Exception as exc:
        outcome.append(type(exc).__name__)
held = []
for a, done in zip(averagers, outcome):
    if isinstance(done, int):  # a hung step holds its averager's tensors
        with a.get_tensors() as tensors:
            held.append(sorted({round(float(x), 3) for x in tensors[0].unique()}))
print(json.dumps({"outcome": outcome, "held": held}), flush=True)
import os, psutil
for child in psutil.Process().children(recursive=True):  # a hung averager would hold a shutdown
    child.kill()
os._exit(0)
"""


def leaver(mode: str) -> dict:
    return probe_json(LEAVER, mode, timeout=180)


@pytest.mark.slow
def test_a_sender_that_leaves_waiting_does_not_take_the_average_from_the_others():
    result = leaver("patched")
    assert sorted(result["outcome"], key=str) == [3, 3, "MatchmakingException"], result  # the leaver gave up
    assert result["held"] == [[2.0], [2.0]], result  # the mean of all three: the leaver's part was in


@pytest.mark.slow
def test_without_the_patch_the_reducer_waits_for_ever():
    result = leaver("plain")
    assert "TimeoutError" in result["outcome"], result
