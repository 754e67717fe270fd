"""Tasks and awaited futures stay alive until they are done.

Upstream: ``hivemind/utils/mpfuture.py``, ``MPFuture.__await__`` (wrapped); the tasks that
hivemind's background loops start and drop (``DHT._run``, ``DecentralizedAverager._run``,
matchmaking) through ``asyncio.create_task``; and Python's
``asyncio.streams.StreamReaderProtocol.connection_made`` (wrapped), whose task serves each
connection to a unix-socket server (how p2pd hands a peer's stream to our handlers).

Without it: asyncio keeps only weak references to tasks, and ``MPFuture`` only weak references to
its futures. A chain of tasks whose leaf awaits such a future (a DHT store from the averager, a
step's trigger, a reply) has no strong holder, and the garbage collector destroys it mid-await
("Task was destroyed but it is pending!"). When that hits the matchmaking chain inside
``look_for_group``, its lock is never released and every later averaging round fails with "could
not find a group" until the process ends; in a DHT process the caller of ``run_coroutine`` gets
``GeneratorExit``. A connection's serving task is collected mid-stream ("cannot reuse already
awaited coroutine"), and the peer sending that stream sees it reset.

Fix: ``asyncio.create_task`` keeps every task in a set until it is done, ``MPFuture.__await__``
keeps the future until the await ends, and ``connection_made`` keeps its serving task. This
replaces ``asyncio.create_task`` process-wide: tests install it only in subprocesses.

Kind: bug fix (belongs upstream; docs/hivemind/task_references.patch)

Shown: ``tests/test_hivemind_ext.py`` (a task awaiting a future only it holds is lost without
this, completes with it; likewise a connection's serving task).
"""

from __future__ import annotations

import asyncio

REPLACES = ["hivemind.utils.mpfuture.MPFuture.__await__"]

_alive: set = set()  # tasks not done yet and MPFutures being awaited, in this process


def install() -> None:
    from hivemind.utils.mpfuture import MPFuture

    create_task = asyncio.create_task

    def create_task_kept(coro, **kwargs):
        task = create_task(coro, **kwargs)
        _alive.add(task)
        task.add_done_callback(_alive.discard)
        return task

    asyncio.create_task = create_task_kept
    original = MPFuture.__await__

    def __await__(self):
        _alive.add(self)
        try:
            return (yield from original(self))
        finally:
            _alive.discard(self)

    MPFuture.__await__ = __await__  # type: ignore[method-assign]

    # the task that serves each incoming connection of a unix-socket server (how p2pd hands a peer's
    # stream to our handlers) comes from loop.create_task, held only by its own protocol
    protocol = asyncio.streams.StreamReaderProtocol
    made = protocol.connection_made

    def connection_made(self, transport) -> None:
        made(self, transport)
        task = getattr(self, "_task", None)
        if task is not None and not task.done():
            _alive.add(task)
            task.add_done_callback(_alive.discard)

    protocol.connection_made = connection_made  # type: ignore[method-assign]
