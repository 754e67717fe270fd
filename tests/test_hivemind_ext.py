"""hivemind_ext's extensions, each shown with and without in a fresh interpreter: every extension
installed ("all") against all but the one under test (the first argument of each probe).
``task_references``: tasks nobody keeps and the MPFutures they await survive garbage collection,
and so does the task serving a connection to a unix-socket server; ``state_records``: an averager
renews its state record before the record expires, and does not store it again for each averaged
tensor; ``leader_poll``: matchmaking fetches the averagers at a pace; ``one_write``: a daemon
message is one write; ``step_cancel``: a cancelled averaging step reads cancelled by the time the
averager hears of the cancel; ``no_rerun``: a step whose all-reduce ran and failed is not run
again; ``nearest_cache``: a store of a key goes where the key's last store went."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from probes import probe_json, run_probe

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast

ROOT = Path(__file__).resolve().parents[1]

# As in hivemind's background loops: a task nobody keeps awaits a future only it holds (an MPFuture
# with its weak registry, or a plain asyncio future); the probe collects garbage, then resolves it.
PROBE = """
import asyncio, gc, sys, weakref
from hivemind.utils.mpfuture import MPFuture
from dedloc_core.engine import hivemind_ext
hivemind_ext.install(skip=() if sys.argv[1] == "all" else sys.argv[1].split(","))

async def main():
    done = asyncio.Event()
    async def waiter(fut):
        await fut
        done.set()
    fut = MPFuture() if sys.argv[2] == "mpfuture" else asyncio.get_running_loop().create_future()
    asyncio.create_task(waiter(fut))
    alive = weakref.ref(fut)
    del fut
    await asyncio.sleep(0.05)
    gc.collect()
    if alive() is None:
        print("lost")
        return
    alive().set_result(1)
    try:
        await asyncio.wait_for(done.wait(), 5)
        print("completed")
    except TimeoutError:
        print("hung")

asyncio.run(main())
"""


def probe(mode: str, future: str) -> str:
    return run_probe(PROBE, mode, future)


@pytest.mark.parametrize("future", ["mpfuture", "asyncio"])
def test_an_awaiting_task_survives_garbage_collection_with_the_patch(future):
    assert probe("all", future) == "completed"


@pytest.mark.parametrize("future", ["mpfuture", "asyncio"])
def test_without_the_patch_the_awaiting_task_is_lost(future):
    # the bug the patch exists for; if a new hivemind or Python fixes it, this fails and the patch can go
    assert probe("task_references", future) == "lost"


# state_records: an averager's "I share my state" record, read from another peer's DHT every 50 ms for
# three lifetimes (2 s each). Prints the least time the old record had left when a renewal was
# seen, and how often the record was missing after it first appeared.
RECORDS = """
import sys, time
import torch, hivemind
from hivemind.averaging import DecentralizedAverager
from hivemind.utils import get_dht_time
from dedloc_core.engine import hivemind_ext
hivemind_ext.install(skip=() if sys.argv[1] == "all" else sys.argv[1].split(","))
first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
second = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs())
averager = DecentralizedAverager([torch.zeros(4)], first, prefix="records", start=True, declare_state_period=2.0)
subkey = averager.peer_id.to_bytes()
last, least, missing = None, float("inf"), 0
end = time.monotonic() + 6.5
while time.monotonic() < end:
    found = second.get("records.all_averagers", latest=True)
    record = found.value.get(subkey) if found is not None else None
    now = get_dht_time()
    if record is None:
        missing += last is not None
    elif last is not None and record.expiration_time > last:
        least = min(least, last - now)
    if record is not None:
        last = record.expiration_time
    time.sleep(0.05)
print(f"{least:.3f} {missing}")
averager.shutdown(); second.shutdown(); first.shutdown()
"""


def renewals(mode: str) -> tuple[float, int]:
    least, missing = run_probe(RECORDS, mode).split()
    return float(least), int(missing)


def test_a_state_record_is_renewed_while_it_still_has_half_its_life():
    least, missing = renewals("all")
    assert least >= 0.7, f"a renewal came {least:.3f} s before the old record expired (half a life is 1 s)"
    assert missing == 0


def test_without_the_patch_a_state_record_is_renewed_only_as_it_expires():
    least, _ = renewals("state_records")
    assert least < 0.3, least


# state_records: how often two averagers store their state records while they run 3 all-reduce rounds of
# 24 tensors (hivemind's all-reduce wakes the record's loop after every averaged tensor). The
# stores are counted in the averagers' processes (forked after the count is set up).
ROUND_RECORDS = """
import multiprocessing as mp, sys, threading, time
import torch, hivemind
from hivemind.averaging import DecentralizedAverager
from dedloc_core.engine import hivemind_ext
hivemind_ext.install(skip=() if sys.argv[1] == "all" else sys.argv[1].split(","))
stores = mp.Value("i", 0)
store = hivemind.DHT.store
def counted(self, key, *args, **kwargs):
    if str(key).endswith(".all_averagers"):
        with stores.get_lock():
            stores.value += 1
    return store(self, key, *args, **kwargs)
hivemind.DHT.store = counted
first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
second = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs())
averagers = [DecentralizedAverager([torch.randn(16) for _ in range(24)], dht, prefix="rounds", start=True,
                                   target_group_size=2, min_matchmaking_time=1.0, request_timeout=0.5)
             for dht in (first, second)]
time.sleep(1.0)
before, rounds = stores.value, 0
for _ in range(3):
    controls = [a.step(wait=False, timeout=10) for a in averagers]
    rounds += all(c.result(20) is not None for c in controls)
time.sleep(1.0)
found = second.get("rounds.all_averagers", latest=True)
records = len(found.value) if found is not None else 0
print(rounds, stores.value - before, records)
for a in averagers:
    a.shutdown()
second.shutdown(); first.shutdown()
"""


def round_records(mode: str) -> tuple[int, int, int]:
    rounds, stores, records = run_probe(ROUND_RECORDS, mode).split()
    return int(rounds), int(stores), int(records)


def test_all_reduce_rounds_do_not_store_the_state_record_again():
    rounds, stores, records = round_records("all")
    assert rounds == 3
    assert stores == 0, f"{stores} state-record stores during 3 rounds (nothing in the record changed)"
    assert records == 2  # both averagers still declared


def test_without_the_patch_every_averaged_tensor_stores_the_record_again():
    rounds, stores, _ = round_records("state_records")
    assert rounds == 3
    assert stores >= 3 * 2 * 4, stores  # hivemind: a wake per averaged tensor, a store per wake


# leader_poll: how often a lone averager fetches its group key's averagers from the DHT while it looks
# for a group for 4 s (nobody else there: hivemind fetches again as soon as a fetch returns).
LEADER_POLL = """
import multiprocessing as mp, sys, time
import torch, hivemind
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.key_manager import GroupKeyManager
from dedloc_core.engine import hivemind_ext
hivemind_ext.install(skip=() if sys.argv[1] == "all" else sys.argv[1].split(","))
fetches = mp.Value("i", 0)
get_averagers = GroupKeyManager.get_averagers
async def counted(self, *args, **kwargs):
    with fetches.get_lock():
        fetches.value += 1
    return await get_averagers(self, *args, **kwargs)
GroupKeyManager.get_averagers = counted
dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
averager = DecentralizedAverager([torch.randn(16)], dht, prefix="poll", start=True, target_group_size=2,
                                 min_matchmaking_time=4.0, request_timeout=0.5)
t0 = time.monotonic()
try:
    averager.step(timeout=4.0)
except Exception as exc:
    print(type(exc).__name__, file=sys.stderr)
print(fetches.value, time.monotonic() - t0)
averager.shutdown()
dht.shutdown()
"""


def leader_fetches(mode: str) -> tuple[int, float]:
    fetches, seconds = run_probe(LEADER_POLL, mode).split()
    return int(fetches), float(seconds)


def test_a_search_for_a_group_fetches_the_averagers_at_a_pace():
    from dedloc_core.engine.hivemind_ext import LEADER_POLL_SECONDS

    fetches, seconds = leader_fetches("all")
    assert seconds >= 3.5  # it searched for its whole matchmaking time
    assert 2 <= fetches <= seconds / LEADER_POLL_SECONDS + 2, (fetches, seconds)


def test_without_the_patch_a_search_fetches_the_averagers_back_to_back():
    fetches, seconds = leader_fetches("leader_poll")
    assert seconds >= 3.5
    assert fetches >= 10 * seconds / 0.5, (fetches, seconds)  # far above the patch's pace


# one_write: how many writes (each a send on p2pd's unix socket) a unary call's request takes, and
# that the daemon's reader gets the same message back.
WRITES = """
import asyncio, socket, sys
from hivemind.p2p.p2p_daemon_bindings import control
from hivemind.p2p.p2p_daemon_bindings.utils import read_pbmsg_safe
from hivemind.proto import p2pd_pb2 as pb
from dedloc_core.engine import hivemind_ext
hivemind_ext.install(skip=() if sys.argv[1] == "all" else sys.argv[1].split(","))

async def main():
    left, right = socket.socketpair()
    reader, keep = await asyncio.open_connection(sock=right)  # its writer holds the socket open
    _, writer = await asyncio.open_connection(sock=left)
    sends, write = [], writer.transport.write
    writer.transport.write = lambda data: (sends.append(bytes(data)), write(data))
    call = pb.CallUnaryRequest(peer=bytes(range(34)), proto="DHTProtocol.rpc_find", data=b"d" * 300)
    for message in (pb.PersistentConnectionRequest(callId=b"i" * 16, callUnary=call),
                    pb.PersistentConnectionRequest(callId=b"j" * 16)):
        await control.write_pbmsg(writer, message)
        got = pb.PersistentConnectionRequest()
        await read_pbmsg_safe(reader, got)
        assert got == message, got
    print(len(sends))

asyncio.run(main())
"""


def writes(mode: str) -> int:
    return int(run_probe(WRITES, mode, timeout=60))


def test_a_daemon_message_is_one_write():
    assert writes("all") == 2  # two messages (a 2-byte and a 1-byte length), read back intact


def test_without_the_patch_each_length_byte_is_a_write_of_its_own():
    assert writes("one_write") == 3 + 2


# How p2pd hands a peer's stream to our handlers: a connection to a unix-socket server. Its handler
# awaits a future only it holds while the sender's bytes fill the buffer, so reading pauses and the
# event loop lets go of the socket; only the protocol holds the handler's task.
SERVER = """
import asyncio, gc, os, sys, tempfile, weakref
from dedloc_core.engine import hivemind_ext
hivemind_ext.install(skip=() if sys.argv[1] == "all" else sys.argv[1].split(","))

async def main():
    done, holder = asyncio.Event(), {}
    async def handler(reader, writer):
        fut = asyncio.get_running_loop().create_future()
        holder["fut"] = weakref.ref(fut)
        await fut
        await reader.readexactly(1 << 20)
        done.set()
    path = os.path.join(tempfile.mkdtemp(), "s.sock")
    server = await asyncio.start_unix_server(handler, path=path)
    reader, writer = await asyncio.open_unix_connection(path)
    writer.write(b"x" * (1 << 20))
    await asyncio.sleep(0.3)
    gc.collect()
    fut = holder["fut"]()
    if fut is None:
        print("lost")
        return
    fut.set_result(None)
    await writer.drain()
    try:
        await asyncio.wait_for(done.wait(), 5)
        print("completed")
    except TimeoutError:
        print("hung")
    server.close()

asyncio.run(main())
"""


def test_the_task_serving_a_connection_survives_garbage_collection_with_the_patch():
    assert run_probe(SERVER, "all") == "completed"


def test_without_the_patch_the_task_serving_a_paused_connection_is_lost():
    assert run_probe(SERVER, "task_references") == "lost"


# What the averager reads (step.cancelled()) when each of the two messages of StepControl.cancel()
# reaches it: the trigger's cancel and the cancel future's result (in this process, the futures'
# callbacks run as the messages are sent); then the state and "triggered" after cancel() returns.
CANCEL = """
import sys
from hivemind.averaging.control import StepControl
from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture
from dedloc_core.engine import hivemind_ext
hivemind_ext.install(skip=() if sys.argv[1] == "all" else sys.argv[1].split(","))

MPFuture()  # hivemind starts its future backend on the base class only
step = StepControl(scheduled_time=get_dht_time() + 5, deadline=get_dht_time() + 30, allow_retries=True,
                   weight=1.0, data_for_gather=b"")
trigger, cancel = MPFuture(), MPFuture()
step.attach(trigger, cancel)
seen = []
trigger.add_done_callback(lambda _: seen.append(step.cancelled()))
cancel.add_done_callback(lambda _: seen.append(step.cancelled()))
step.cancel()
print(*seen, step.cancelled(), step.triggered)
try:  # shutdown paths cancel a step that a round already cancelled
    step.cancel()
except Exception as exc:
    print("second cancel:", type(exc).__name__)
"""


def test_a_cancelled_step_reads_cancelled_when_the_averager_hears_of_it():
    assert run_probe(CANCEL, "all") == "True True True True"  # and a second cancel raises nothing


def test_without_the_patch_the_averager_hears_of_the_cancel_before_the_step_reads_cancelled():
    # the averager then went on to an all-reduce: the cancelled trigger counts as "triggered"
    assert run_probe(CANCEL, "step_cancel") == "False False True True\nsecond cancel: InvalidStateError"


# Two real averagers on loopback, one all-reduce. The victim's round fails on its side only, after
# the all-reduce ran (as when its last part from a groupmate goes missing); the other peer's succeeds.
# Printed: the other's group size, the victim's outcome, and whether the victim looked for a new group.
RERUN = """
import json, sys, time
import torch, hivemind
from hivemind.averaging import allreduce
from hivemind.averaging.partition import AllreduceException
from dedloc_core.engine import hivemind_ext
hivemind_ext.install(skip=() if sys.argv[1] == "all" else sys.argv[1].split(","))
first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
second = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                      initial_peers=[str(a) for a in first.get_visible_maddrs()])
VICTIM = second.peer_id
run = allreduce.AllReduceRunner.run

async def lossy(self):  # the victim's last output never comes (its reader stops at the last tensor)
    last = None
    async for delta in run(self):
        if last is not None:
            yield last
        last = delta
    if self.peer_id == VICTIM:
        raise AllreduceException("the last part went missing")
    yield last

allreduce.AllReduceRunner.run = lossy
averagers = [hivemind.averaging.DecentralizedAverager([torch.full((1000,), float(v))], dht=d, prefix="rerun",
                                                      target_group_size=2, min_matchmaking_time=2.0,
                                                      request_timeout=1.0, start=True)
             for v, d in ((1.0, first), (3.0, second))]
began = time.monotonic()
futures = [a.step(wait=False, timeout=15) for a in averagers]
outcome = [len(futures[0].result(timeout=60))]
try:
    outcome.append(len(futures[1].result(timeout=60)))
except Exception as exc:
    outcome.append(type(exc).__name__)
print(json.dumps(outcome))
for a in averagers:
    a.shutdown()
for d in (first, second):
    d.shutdown()
"""


def rerun(mode: str) -> tuple[list, bool]:
    out = subprocess.run([sys.executable, "-c", RERUN, mode], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), "retrying" in out.stderr


@pytest.mark.slow
def test_a_step_whose_all_reduce_failed_fails_at_once():
    outcome, retried = rerun("all")
    assert outcome == [2, "MatchmakingException"] and not retried


@pytest.mark.slow
def test_without_the_patch_the_step_looks_for_a_new_group_until_its_deadline():
    outcome, retried = rerun("no_rerun")
    assert outcome[0] == 2 and retried  # nobody else is looking: the retries find no group


# nearest_cache: the finds a peer's DHT sends while it stores the same key three times among four DHTs on
# loopback, then once more after one of the nodes that held it has left, and once after that.
STORES = """
import json, multiprocessing as mp, sys
import hivemind
from hivemind.dht.protocol import DHTProtocol
from hivemind.utils import get_dht_time
from dedloc_core.engine import hivemind_ext
hivemind_ext.install(skip=() if sys.argv[1] == "all" else sys.argv[1].split(","))
finds, valued = mp.Value("i", 0), mp.Value("i", 0)
call_find = DHTProtocol.call_find
async def counted(self, *args, **kwargs):
    with finds.get_lock():
        finds.value += 1
    answer = await call_find(self, *args, **kwargs)
    with valued.get_lock():  # answers that carried the record
        valued.value += sum(found is not None for found, _ in (answer or {}).values())
    return answer
DHTProtocol.call_find = counted
local = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
first = hivemind.DHT(start=True, **local)
nodes = [first] + [hivemind.DHT(start=True, initial_peers=first.get_visible_maddrs(), **local) for _ in range(3)]
storer = nodes[1]
stored_valued = 0  # answers to a store's searches that carried the record
def store(value):
    global stored_valued
    before, before_valued = finds.value, valued.value
    ok = storer.store("progress", value, get_dht_time() + 60)
    stored_valued += valued.value - before_valued
    return ok, finds.value - before
def seen(readers):
    return [reader.get("progress", latest=True).value for reader in readers]
rows = []
for value in range(3):
    ok, sent = store(value)
    rows.append([ok, sent, seen(nodes)])
nodes[3].shutdown()
for value in range(3, 5):
    ok, sent = store(value)
    rows.append([ok, sent, seen(nodes[:3])])
print(json.dumps(dict(rows=rows, valued=stored_valued)))
for node in nodes[:3]:
    node.shutdown()
"""


def store_finds(mode: str) -> dict:
    return probe_json(STORES, mode, timeout=180)


def test_a_peer_stores_a_key_where_its_last_store_of_it_went_without_searching_again():
    out = store_finds("all")
    rows = out["rows"]
    assert [ok for ok, _, _ in rows] == [True] * 5
    assert [values for _, _, values in rows] == [[0] * 4, [1] * 4, [2] * 4, [3] * 3, [4] * 3]  # every node has it
    sends = [sent for _, sent, _ in rows]
    assert sends[0] > 0 and sends[1] == sends[2] == 0, sends  # found once, then reused
    assert sends[3] == 0 and sends[4] > 0, sends  # the store that met the gone node drops it: the next searches
    assert out["valued"] == 0  # its searches ask beside the key: no answer carries the record


def test_without_the_patch_every_store_searches_the_dht_first():
    out = store_finds("nearest_cache")
    rows = out["rows"]
    assert [ok for ok, _, _ in rows] == [True] * 5
    assert all(sent > 0 for _, sent, _ in rows), rows
    assert out["valued"] > 0  # and the nodes that hold the record send it with their answers
