"""Helper threads, a switch: hivemind's DHT (and optionally its averagers) as threads of the process.

Upstream: ``hivemind/dht/dht.py`` (``DHT.run`` run in a thread, ``DHT.replicate_p2p`` replaced
whole, its module's ``signal``), ``hivemind/averaging/averager.py``
(``DecentralizedAverager._run_internal`` run in a thread), ``hivemind/utils/mpfuture.py``
(``MPFuture.set_result``, ``set_exception``, ``cancel``, ``__del__`` wrapped,
``_set_event_threadsafe`` replaced whole) and ``hivemind/averaging/control.py``
(``StepControl.__del__`` wrapped).

Without it: hivemind runs ``DHT`` and every ``DecentralizedAverager`` (the Optimizer's gradient
and state averagers) as forked processes that talk to their creator through pipes and
``MPFuture``. Each fork costs private memory (pages of the parent's heap it touches;
``bench/overhead.py``: DHT 52, averagers 15 and 39 MiB USS). The DHT's loop needs little CPU and
waits on sockets, so a thread serves as well.

Fix: a switch. ``install("dht")`` runs the DHT as a thread (the worker's tree 1.59x the bare loop
instead of 1.70x). ``install("all")`` makes the averagers threads too (1.43x), but their all-reduces then wait on
the training loop for the GIL: in the network lab, with overlap, rounds took 5-8 s instead of
1.4-2.3 s (bench/README.md). Neither is the default (``DEDLOC_HELPER_THREADS`` is ``none``,
hivemind's processes): with the DHT in the worker process, its work for the swarm after a pause
counts in that process, and the pause through the app (``bench/app_pause.py``, the worker under
5% of a core) took p50 2.6 s / p95 12.3 s, against 65 / 125 ms with the DHT as a process. A
volunteer feels the pause; 0.1x of memory less does not pay for it. What a helper as a thread
changes:

- ``start`` runs the process body (``DHT.run``, ``DecentralizedAverager._run_internal``) in a daemon
  thread; ``is_alive``, ``join`` and ``terminate`` follow that thread (a thread cannot be killed:
  ``terminate`` only says so; shutdown goes through hivemind's pipe as before);
- ``signal.signal`` in ``DHT.run`` is skipped outside the main thread (Python refuses it there);
- ``MPFuture``: pipes pickle a future, so its other end is a copy in the same process. hivemind
  settles a future in place when the pid is its origin's, which on a copy never reached the
  original (its waiter hung). Settling a copy now settles the original (the result is handed
  over as is, not pickled), and a copy's ``__del__`` leaves the original registered. A future's
  asyncio event is set in place when its loop is idle (hivemind ran that loop to set it, which
  fails in a thread that runs a loop of its own);
- ``DHT.replicate_p2p`` keeps one replica per event loop (each averager thread has its own loop;
  a replica's streams belong to the loop that opened them).

Kind: our policy

Shown: ``tests/test_helper_threads.py`` (without this a future settled through its copy never
reaches its original; with it two peers average with the DHT as a thread).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal as _signal
import threading
import types
import weakref

logger = logging.getLogger(__name__)

REPLACES = [
    "hivemind.dht.dht.DHT.run",
    "hivemind.dht.dht.DHT.replicate_p2p",
    "hivemind.averaging.averager.DecentralizedAverager._run_internal",
    "hivemind.utils.mpfuture.MPFuture.set_result",
    "hivemind.utils.mpfuture.MPFuture.set_exception",
    "hivemind.utils.mpfuture.MPFuture.cancel",
    "hivemind.utils.mpfuture.MPFuture.__del__",
    "hivemind.utils.mpfuture.MPFuture._set_event_threadsafe",
    "hivemind.averaging.control.StepControl.__del__",
]

_installed = False


def install(which: str | None = None) -> None:
    """Apply the changes above (idempotent) to ``which``: "dht", "all" (the averagers too) or
    "none"; by default what ``DEDLOC_HELPER_THREADS`` says ("none"). Call before creating a DHT."""
    global _installed
    if which is None:
        from dedloc_core import environ

        which = environ.HELPER_THREADS.text()
    if _installed or which == "none":
        return
    if which not in ("dht", "all"):
        raise ValueError(f"helper threads: {which!r} is not dht, all or none")
    _installed = True
    from hivemind.averaging.averager import DecentralizedAverager
    from hivemind.dht import dht as dht_module

    _as_thread(dht_module.DHT, "run", "dht")
    if which == "all":
        _as_thread(DecentralizedAverager, "_run_internal", "averager")
    dht_module.signal = _main_thread_signal()
    _patch_replicas(dht_module.DHT)
    _patch_futures()


def _as_thread(cls: type, body: str, name: str) -> None:
    def start(self) -> None:
        if getattr(self, "_helper_thread", None) is not None:
            raise RuntimeError(f"{name} already started")
        self._helper_thread = threading.Thread(target=getattr(self, body), name=f"hivemind-{name}", daemon=True)
        self._helper_thread.start()

    def is_alive(self) -> bool:
        thread = getattr(self, "_helper_thread", None)
        return thread is not None and thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        thread = getattr(self, "_helper_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def terminate(self) -> None:
        logger.warning("hivemind %s thread did not stop; it ends with the process", name)

    cls.start, cls.is_alive, cls.join, cls.terminate = start, is_alive, join, terminate
    cls.exitcode = property(lambda self: None if self.is_alive() else 0)


def _main_thread_signal() -> types.SimpleNamespace:
    def signal(signum, handler):
        if threading.current_thread() is threading.main_thread():
            return _signal.signal(signum, handler)
        return None

    return types.SimpleNamespace(signal=signal, SIGINT=_signal.SIGINT, SIG_IGN=_signal.SIG_IGN)


def _patch_replicas(dht_cls: type) -> None:
    from hivemind.p2p import P2P

    async def replicate_p2p(self) -> P2P:
        replicas = self.__dict__.setdefault("_loop_replicas", weakref.WeakKeyDictionary())
        loop = asyncio.get_running_loop()
        if loop not in replicas:
            maddr = self.run_coroutine(dht_cls._get_p2p_daemon_listen_maddr)
            replicas[loop] = await P2P.replicate(maddr)
        return replicas[loop]

    dht_cls.replicate_p2p = replicate_p2p


def _patch_futures() -> None:
    from hivemind.averaging.control import StepControl
    from hivemind.utils.mpfuture import MPFuture

    def original_of(future: MPFuture) -> MPFuture | None:
        """The future that ``future``, unpickled in its own origin process (the other end of a pipe
        to a helper thread), is a copy of; None for an original or another process's copy."""
        if os.getpid() != future._origin_pid or MPFuture._active_futures is None:
            return None
        ref = MPFuture._active_futures.get(future._uid)
        original = ref() if ref is not None else None
        return original if original is not future else None

    def on_original(method):
        @functools.wraps(method)
        def settle(self, *args):
            original = original_of(self)
            return method(self if original is None else original, *args)

        return settle

    def unless_copy(method):
        @functools.wraps(method)
        def delete(self):
            if original_of(self) is None:
                method(self)  # a copy leaves the original registered and says nothing

        return delete

    def set_event(self):
        # hivemind ran an idle loop to set the event, which fails in a thread that runs a loop of its
        # own (a helper thread settling a future the main thread made); an idle loop has no task
        # running, so the event is set in place
        if self._loop.is_closed():
            return
        if not self._loop.is_running():
            self._aio_event.set()
        elif _running_loop() is self._loop:
            self._aio_event.set()
        else:
            self._loop.call_soon_threadsafe(self._aio_event.set)

    MPFuture.set_result = on_original(MPFuture.set_result)
    MPFuture.set_exception = on_original(MPFuture.set_exception)
    MPFuture.cancel = on_original(MPFuture.cancel)
    MPFuture.__del__ = unless_copy(MPFuture.__del__)
    StepControl.__del__ = unless_copy(StepControl.__del__)  # its "deleted before triggered" warning too
    MPFuture._set_event_threadsafe = set_event


def _running_loop():
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
