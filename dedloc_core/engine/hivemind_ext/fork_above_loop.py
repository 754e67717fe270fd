"""Helpers forked above the loop: hivemind's processes keep their scheduling class.

Upstream: ``DHT.start`` and ``DecentralizedAverager.start`` (``multiprocessing.Process.start``,
the fork; ``hivemind/dht/dht.py``, ``hivemind/averaging/averager.py``), wrapped.

Without it: a child inherits its forking thread's scheduling class, and the training loop's thread
goes to SCHED_IDLE (``limits.training_below_helpers``), which it cannot leave: a rejoin's session
(a lost relay) forks its helpers from there, level with the loop, and they starve beside it.

Fix: the DHT and the averagers start on ``limits.above_the_loop``'s thread. hivemind's
``signal.signal`` calls stay in the calling thread. Installed after ``helper_threads``: it wraps
whichever ``start`` that left.

Kind: our policy

Shown: ``tests/test_loop_priority.py`` (a rejoin's helpers are not SCHED_IDLE; without this they are).
"""

from __future__ import annotations

REPLACES: list[str] = []  # multiprocessing's start, not hivemind's code


def install() -> None:
    from hivemind.averaging.averager import DecentralizedAverager
    from hivemind.dht import DHT

    from dedloc_core.engine import limits

    for cls in (DHT, DecentralizedAverager):
        def start(self, _start=cls.start) -> None:
            limits.above_the_loop(_start, self)

        cls.start = start
