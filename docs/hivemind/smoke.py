"""Smoke checks of the bug fixes in docs/hivemind/*.patch, one line per check.

Run with the hivemind to check first on the path, e.g.
``PYTHONPATH=/tmp/hm_all python docs/hivemind/smoke.py`` (patched) or with the pristine 1.1.12:
on the patched copy every line says "fixed", on the pristine one "bug".
Import only hivemind here: no dedloc extension may be installed in this process.
"""

import asyncio
import os
import signal
import subprocess
import sys
import time

import hivemind
import numpy as np
import torch
from hivemind.averaging.control import StepControl
from hivemind.averaging.partition import AllreduceException, TensorPartContainer, TensorPartReducer
from hivemind.compression import quantization as q
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings import utils as p2p_utils
from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture

results = []
MPFuture()  # the MPFuture backend must be set up by MPFuture itself before the first StepControl


def report(name, fixed, detail=""):
    results.append(fixed)
    print(f"{name:24s} {'fixed' if fixed else 'bug  '}  {detail}")


def check(name):
    def wrap(fn):
        try:
            fixed, detail = fn()
        except Exception as e:
            fixed, detail = False, f"{type(e).__name__}: {e}"[:160]
        report(name, fixed, detail)
        return fn

    return wrap


@check("codecs_numpy2")
def _():
    codec = q.Uniform8BitQuantization()
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    y = codec.extract(codec.compress(x, info=None))
    error = float((x - y).abs().mean())
    return error < 0.05, f"numpy {np.__version__}: roundtrip mean error {error:.4f}"


@check("one_write")
def _():
    writes = []

    class Writer:
        def write(self, data):
            writes.append(bytes(data))

        async def drain(self):
            pass

    from hivemind.proto import p2pd_pb2

    msg = p2pd_pb2.Request(type=p2pd_pb2.Request.IDENTIFY)
    asyncio.run(p2p_utils.write_pbmsg(Writer(), msg))
    body = msg.SerializeToString()
    return len(writes) == 1 and b"".join(writes)[-len(body):] == body, f"{len(writes)} write(s) for one message"


@check("step_cancel")
def _():
    step = StepControl(scheduled_time=get_dht_time(), deadline=get_dht_time() + 5, allow_retries=True, weight=1.0,
                       data_for_gather=b"")
    trigger, cancel = MPFuture(), MPFuture()
    seen = []
    cancel.add_done_callback(lambda _: seen.append(step.cancelled()))
    step.attach(trigger, cancel)
    step.cancel()
    try:
        step.cancel()  # a second cancel
        second = "nothing"
    except Exception as e:
        second = type(e).__name__
    return seen == [True] and second == "nothing", f"cancelled() as the averager hears of it: {seen}; " \
        f"a second cancel raised {second}"


@check("no_rerun")
def _():
    step = StepControl(scheduled_time=get_dht_time(), deadline=get_dht_time() + 5, allow_retries=True, weight=1.0,
                       data_for_gather=b"")
    step.began_allreduce = True
    step.attach(MPFuture(), MPFuture())
    step.cancel()
    return not step.allow_retries, f"allow_retries after all-reduce began: {step.allow_retries}"


@check("robust_reduce")
def _():
    async def twice():
        reducer = TensorPartReducer([torch.Size([2])], num_senders=3)
        reducer.on_sender_failed(2)
        reducer.on_sender_failed(2)  # the same sender reported lost again
        return None if reducer.num_current_senders == 2 else f"{reducer.num_current_senders} of 2 senders counted"

    container = TensorPartContainer([torch.zeros(4)], peer_fractions=(1.0,))
    try:
        container.register_processed_part(0, 0, torch.full((4,), float("nan")))
        nan = "a NaN average registered"
    except AllreduceException:
        nan = None
    bugs = [bug for bug in (asyncio.run(twice()), nan) if bug]
    return not bugs, "; ".join(bugs) or "on_sender_failed counts once, a NaN average refused"


@check("optimizer_init")
def _():
    from hivemind.optim.state_averager import initialize_optimizer_state_

    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([param], lr=1e-2, weight_decay=0.1)
    initialize_optimizer_state_(opt)
    step = float(opt.state[param]["step"])
    moved = float((param.detach() - 1).abs().max())
    return step == 0 and moved == 0, f"step count {step:g}, parameters moved {moved:.1e}"


@check("optimizer_client_mode")
def _():
    import inspect

    from hivemind.optim import optimizer

    source = inspect.getsource(optimizer.Optimizer.__init__)
    fixed = "dht.client_mode if client_mode is None else client_mode" in source
    return fixed, "Optimizer.__init__ keeps an explicit client_mode" if fixed else "explicit client_mode replaced"


@check("leader_poll")
def _():
    from hivemind.averaging.matchmaking import PotentialLeaders

    calls = []

    class Keys:
        current_key = "key"

        async def get_averagers(self, key, only_active):
            calls.append(time.monotonic())
            leaders.update_triggered.set()  # as pop_next_leader does when no leader is better than us
            return []

    async def run():
        global leaders
        leaders = PotentialLeaders(PeerID(b"x" * 34), min_matchmaking_time=5.0, target_group_size=None)
        leaders.running.set()
        leaders.search_end_time = get_dht_time() + 1.0
        await leaders._update_queue_periodically(Keys())

    asyncio.run(run())
    return len(calls) <= 4, f"{len(calls)} DHT fetches in 1 s of matchmaking"


@check("state_records")
def _():
    from types import SimpleNamespace

    from hivemind.averaging.averager import DecentralizedAverager

    stores = []

    async def store(*args, **kwargs):
        stores.append(kwargs.get("value"))

    async def run():
        fake = SimpleNamespace(
            _matchmaking=SimpleNamespace(group_key_manager=SimpleNamespace(prefix="p")),
            allow_state_sharing=True, state_sharing_priority=0.0, declare_state_period=30.0,
            dht=SimpleNamespace(store=store), peer_id=SimpleNamespace(to_bytes=lambda: b"me"),
            _state_updated=asyncio.Event(),
        )
        task = asyncio.create_task(DecentralizedAverager._declare_for_download_periodically(fake))
        for _ in range(20):  # an all-reduce sets the event after every averaged tensor
            await asyncio.sleep(0.005)
            fake._state_updated.set()
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(run())
    return len(stores) == 1, f"{len(stores)} stores of an unchanged record in 0.1 s"


def _spawn(code):
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=os.environ)


@check("dht_orphans")
def _():
    dht = hivemind.DHT(start=True)
    try:
        dht._outer_pipe.send_bytes(b"not a pickle")  # a message whose unpickling fails, as a gone caller's
        time.sleep(0.5)
        alive = dht.is_alive()
        ok = alive and dht.get("key", latest=True) is None
        return ok, "the DHT answers after a request it cannot unpickle" if ok else f"DHT process alive: {alive}"
    finally:
        if dht.is_alive():
            dht.shutdown()


@check("task_references")
def _():
    import gc

    from hivemind.utils.asyncio import switch_to_uvloop

    async def orphan():
        await asyncio.get_running_loop().create_future()  # a future that nobody else holds

    async def main():
        asyncio.create_task(orphan())  # fire-and-forget, as hivemind's background loops do
        await asyncio.sleep(0.01)
        gc.collect()
        return len(asyncio.all_tasks()) - 1

    loop = switch_to_uvloop()
    try:
        alive = loop.run_until_complete(main())
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
    return alive == 1, f"{alive} of 1 fire-and-forget task alive after gc.collect()"


@check("replica_sockets")
def _():
    import tempfile

    from hivemind.averaging import DecentralizedAverager
    from hivemind.p2p import P2P

    folder, prefix = tempfile.mkdtemp(prefix="hm_smoke_"), P2P._UNIX_SOCKET_PREFIX
    P2P._UNIX_SOCKET_PREFIX = f"/unix{folder}/hivemind-"
    dht = hivemind.DHT(start=True)
    averager = DecentralizedAverager([torch.zeros(2)], dht=dht, prefix="smoke", target_group_size=2, start=True)
    averager.shutdown()
    dht.shutdown()
    time.sleep(0.5)
    left = [name for name in os.listdir(folder) if "p2pclient" in name]
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    os.rmdir(folder)
    P2P._UNIX_SOCKET_PREFIX = prefix
    return not left, f"{len(left)} client socket file(s) left after the averager and the DHT shut down"


@check("child_lifetime")
def _():
    code = (
        "import os, time, hivemind\n"
        "dht = hivemind.DHT(start=True)\n"
        "kids = open(f'/proc/{dht.pid}/task/{dht.pid}/children').read().split()\n"
        "print(dht.pid, *kids, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = _spawn(code)
    pids = [int(p) for p in parent.stdout.readline().split()]
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    time.sleep(1.0)
    left = [p for p in pids if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"]
    for pid in left:  # clean up what a pristine hivemind leaves behind
        os.kill(pid, signal.SIGKILL)
    return not left, f"{len(left)} of {len(pids)} children (DHT, p2pd) alive 1 s after the parent's SIGKILL"


@check("stream_end")
def _():
    from hivemind.p2p import P2P
    from hivemind.proto import averaging_pb2

    closed = []
    add_binary = P2P.add_binary_stream_handler

    async def add_timed(self, name, handle, balanced=False):
        async def timed(*args):
            try:
                await handle(*args)
            finally:
                closed.append(time.monotonic())
        await add_binary(self, name, timed, balanced=balanced)

    async def answers(stream, context):
        async for request in stream:
            yield request

    async def requests():
        for i in range(3):
            yield averaging_pb2.AveragingData(group_id=bytes([i]))

    async def main():
        server = await P2P.create()
        client = await P2P.create(initial_peers=await server.get_visible_maddrs())
        P2P.add_binary_stream_handler = add_timed
        try:
            await server.add_protobuf_handler("answers", answers, averaging_pb2.AveragingData, stream_input=True,
                                              stream_output=True)
            stream = await client._iterate_protobuf_stream_handler(server.peer_id, "answers", requests(),
                                                                   averaging_pb2.AveragingData)
            got = [await stream.__anext__() for _ in range(3)]
            read = time.monotonic()
            await asyncio.sleep(0.5)  # answers read, the stream held open
            got += [response async for response in stream]
            await asyncio.sleep(0.1)
            return len(got), closed[0] - read
        finally:
            P2P.add_binary_stream_handler = add_binary
            await client.shutdown()
            await server.shutdown()

    got, after = asyncio.run(main())
    return got == 3 and after >= 0.4, f"{got} answers; the handler closed {after:+.2f} s after the caller read them"


print(f"hivemind {hivemind.__version__} from {os.path.dirname(hivemind.__file__)}: "
      f"{sum(results)} of {len(results)} fixed")
