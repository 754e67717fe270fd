"""A peer that leaves first sends the averages it still owes.

Upstream: ``hivemind/averaging/allreduce.py``: ``AllReduceRunner.rpc_aggregate_part`` (wrapped);
``hivemind/averaging/averager.py``: ``DecentralizedAverager._shutdown`` (wrapped, outside
``replica_sockets``).

Without it: a reducer's own step returns once its own outputs are in, but it may still owe other
members their averaged parts: hivemind sends a zero-share peer's results (the slowest peers, whom
the load balancing gives no part to reduce) only after that peer's whole input has arrived. A peer
that leaves cleanly right after its step (hivemind's ``Optimizer.shutdown`` tags along with a running
round, then shuts the averagers down) removes its handlers and p2pd under those streams: the
zero-share peers log "received 0.0% results" and, with ``partial_rounds``, fail the round (or,
with ``no_rerun``, average again among themselves, a matchmaking later).

Fix: every ``rpc_aggregate_part`` stream is counted while it runs, per event loop (an averager's);
``_shutdown`` waits until none runs, and ``LINGER_SECONDS`` after the last one ended (at most
``DRAIN_SECONDS`` in all), before it removes the handlers: a stream's last bytes may still sit in
p2pd's buffers and on the link when the handler returns.

Kind: our policy (how long a leaving peer keeps serving the round it was in, which delays its exit)

Shown: ``tests/test_leave_drain.py`` (slow, root: four averagers on shaped links, the only reducer
leaving the moment its step returns; its senders' round fails without this and passes with it).
"""

from __future__ import annotations

import asyncio
import time

REPLACES = [
    "hivemind.averaging.allreduce.AllReduceRunner.rpc_aggregate_part",
    "hivemind.averaging.averager.DecentralizedAverager._shutdown",
]

# the longest a leaving averager waits for the streams it still serves: under hivemind's
# ``shutdown_timeout`` (5 s), after which the averager's process is terminated
DRAIN_SECONDS = 4.0
# and then, if a stream ended that recently: its last bytes are still on the way (p2pd's buffers, the
# link), and a p2pd killed with them unsent resets the connection
LINGER_SECONDS = 1.5
_running: dict[int, int] = {}  # id(event loop) -> rpc_aggregate_part streams running in it
_last_end: dict[int, float] = {}  # id(event loop) -> when its last stream ended (monotonic)


def running() -> int:
    """Streams running in the current event loop."""
    return _running.get(id(asyncio.get_running_loop()), 0)


def install() -> None:
    from hivemind.averaging import allreduce
    from hivemind.averaging.averager import DecentralizedAverager

    aggregate = allreduce.AllReduceRunner.rpc_aggregate_part

    async def rpc_aggregate_part(self, stream, context):
        loop = id(asyncio.get_running_loop())
        _running[loop] = _running.get(loop, 0) + 1
        try:
            async for message in aggregate(self, stream, context):
                yield message
        finally:
            _running[loop] -= 1
            _last_end[loop] = time.monotonic()

    allreduce.AllReduceRunner.rpc_aggregate_part = rpc_aggregate_part
    shutdown = DecentralizedAverager._shutdown

    async def _shutdown(self, timeout) -> None:
        deadline = time.monotonic() + DRAIN_SECONDS
        while running() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        ended = _last_end.get(id(asyncio.get_running_loop()), -1e9)
        await asyncio.sleep(max(0.0, min(ended + LINGER_SECONDS, deadline) - time.monotonic()))
        await shutdown(self, timeout)

    DecentralizedAverager._shutdown = _shutdown  # type: ignore[method-assign]
