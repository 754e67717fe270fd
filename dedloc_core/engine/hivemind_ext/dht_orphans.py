"""A request from a process that has gone does not stall the DHT.

Upstream: ``hivemind/dht/dht.py``, ``DHT.run`` (wrapped: its pipe end is replaced; this relies on
``run`` reading requests with ``self._inner_pipe.recv()`` and calling the method they name).

Without it: a call to the DHT travels through its pipe with an ``MPFuture``, whose pipe end and
shared state are file descriptors that the DHT process fetches from the caller's
``multiprocessing.resource_sharer`` while it unpickles the message. An averager that asks the DHT
something as it shuts down has exited by then: the fetch fails. ``DHT.run`` catches ``OSError``
and sleeps ``wait_timeout`` (3 s) before reading its pipe again, so the DHT's own shutdown waits
past its 3 s grace and is killed, leaving its p2pd and its two socket files; an ``EOFError`` (the
caller gone mid-handshake) kills the DHT process outright. 6 of 20 lone sessions ended so.

Fix: the DHT reads each message's bytes first (a broken pipe still fails as before) and drops a
message it cannot unpickle: its caller can no longer hear the answer.

Kind: bug fix (belongs upstream; docs/hivemind/dht_orphans.patch)

Shown: ``tests/test_dht_orphans.py`` (the DHT shuts down in time and leaves no socket).
"""

from __future__ import annotations

import functools
import logging

REPLACES = ["hivemind.dht.dht.DHT.run"]


class _OrphanTolerantPipe:
    """The DHT's end of its pipe, whose ``recv`` drops a message it cannot unpickle."""

    def __init__(self, conn) -> None:
        self._conn = conn

    def __getattr__(self, name):
        return getattr(self._conn, name)

    def recv(self):
        from multiprocessing.reduction import ForkingPickler

        data = self._conn.recv_bytes()  # a broken pipe raises here, as before
        try:
            return ForkingPickler.loads(data)
        except Exception as exc:  # whatever the caller's process left behind
            logging.getLogger(__name__).debug("The DHT dropped a request from a process that has gone (%r)", exc)
            return "_drop_request", [], {}


def install() -> None:
    from hivemind.dht import DHT

    run = DHT.run

    @functools.wraps(run)
    def run_tolerant(self) -> None:  # the DHT's body, in its process (or thread: helper_threads)
        if not isinstance(self._inner_pipe, _OrphanTolerantPipe):
            self._inner_pipe = _OrphanTolerantPipe(self._inner_pipe)
        run(self)

    async def _drop_request(self) -> None:
        return None

    DHT.run = run_tolerant  # type: ignore[method-assign]
    DHT._drop_request = _drop_request
