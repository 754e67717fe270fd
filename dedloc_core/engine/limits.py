"""Limits the worker applies to itself (its priority: ``priority``): CPU threads, GPU on/off and
memory cap, bandwidth caps, and a pause gate that stops training within a fraction of a second.

The gate is checked between micro-batches and also *inside* them: forward pre-hooks on the
model's modules and gradient hooks on its parameters call ``PauseGate.check()``, so a pause takes
effect in the middle of a forward or backward pass instead of at its end.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from dedloc_core.protocol import Limits

from . import bandwidth

logger = logging.getLogger(__name__)

def training_below_helpers() -> int:
    """Put the training loop (the calling thread), torch's compute threads and the threads the loop
    starts later below the worker's helper processes (hivemind's DHT and averagers, p2pd, forked
    before this call and left at the worker's nice level): Linux's SCHED_IDLE, which an unprivileged
    process may choose for itself. An all-reduce then gets the CPU when it needs it instead of
    waiting behind the loop that waits for it. The process's other Python threads (the app's
    commands, pausing) keep their priority. An unprivileged thread cannot leave SCHED_IDLE: helpers
    that a later session of the same process forks (a rejoin) would inherit it, so hivemind's are
    forked on ``above_the_loop``'s thread (``hivemind_ext.fork_above_loop``). Returns the number of
    threads changed (0 elsewhere)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "SCHED_IDLE"):
        return 0
    _launcher()  # its thread exists before the switch, so it keeps the worker's class
    keep = {t.native_id for t in threading.enumerate()} - {threading.get_native_id()}
    changed = 0
    for tid in map(int, os.listdir("/proc/self/task")):
        if tid in keep:
            continue
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            changed += 1
        except OSError:  # a thread that ended meanwhile
            pass
    return changed


def above_the_loop(fn: Callable, /, *args, **kwargs):
    """``fn(*args, **kwargs)`` on a thread that ``training_below_helpers`` leaves at the worker's
    class; its result or exception. For what forks helper processes (hivemind's DHT, averagers):
    a child inherits its forking thread's class, and the loop's thread cannot leave SCHED_IDLE, so
    a rejoin's helpers forked there would sit level with the loop. The children's parent-death
    signal (``hivemind_ext``) follows this thread, which lives as long as the process."""
    if threading.current_thread().name.startswith(LAUNCHER):
        return fn(*args, **kwargs)  # already there (or in a process forked from there)
    return _launcher().submit(fn, *args, **kwargs).result()


LAUNCHER = "helper-launcher"


_launcher_pool: ThreadPoolExecutor | None = None
_launcher_lock = threading.Lock()


def _launcher() -> ThreadPoolExecutor:
    global _launcher_pool
    with _launcher_lock:
        if _launcher_pool is None:
            _launcher_pool = ThreadPoolExecutor(1, thread_name_prefix=LAUNCHER)
            _launcher_pool.submit(int).result()  # its one thread starts now, at the caller's class
        return _launcher_pool


def _forget_launcher() -> None:
    """In a forked child: the pool's thread stayed in the parent (a submit would wait forever)."""
    global _launcher_pool, _launcher_lock
    _launcher_pool, _launcher_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_launcher)


def merged(base: Limits, update: Limits) -> Limits:
    """``base`` with the fields that ``update`` sets."""
    return base.merged(update)


def apply_cpu_and_network(limits: Limits) -> None:
    if limits.cpu_threads:
        torch.set_num_threads(limits.cpu_threads)
    apply_network(limits)


def apply_network(limits: Limits) -> None:
    """The upload/download caps; from any thread (the buckets are shared memory with a lock)."""
    bandwidth.set_caps(_payload(limits.upload_bps), _payload(limits.download_bps))


def apply_network_over(base: Limits, update: Limits) -> None:
    """The caps of ``base`` with ``update``'s fields; the command reader calls it as a set_limits arrives."""
    apply_network(merged(base, update))


# The buckets pace the payload of hivemind's messages; on the wire come TCP/IP headers, libp2p
# framing (noise, yamux), the daemon's own chatter, and the bytes a sender had pushed into the
# stream and socket buffers of a round that failed before they were read (a capped peer's rounds
# often fail). Measured in the network-namespace test: 1.15 x the paced rate on a quiet machine,
# up to 1.36 x on a loaded one (289.8 kB/s received with the payload paced at 212.5). Paced at
# 75 % of the cap, 5 of 6 runs beside a CPU burner stayed under 0.8 x the cap over 60 s; one showed
# 1.26 x (a state download lands at link speed and is read at the cap: a burst, not a rate).
WIRE_SHARE = 0.75


def _payload(cap: int | None) -> int | None:
    """The payload rate for a cap on the wire (None: unchanged, 0: no cap)."""
    return cap if not cap else max(1, int(cap * WIRE_SHARE))


def gpu_wanted(limits: Limits) -> bool:
    return bool(limits.use_gpu) and torch.cuda.is_available()


def apply_gpu_memory_cap(limits: Limits) -> None:
    """Cap this process's CUDA allocator at ``gpu_memory_mb`` (0: no cap). No-op without CUDA."""
    if limits.gpu_memory_mb is None or not torch.cuda.is_available():
        return
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = 1.0 if limits.gpu_memory_mb == 0 else min(1.0, limits.gpu_memory_mb * 2**20 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, 0)


def bandwidth_hint(limits: Limits) -> float | None:
    """What to tell hivemind's load balancer: the tighter cap (bytes/s), or None (no cap)."""
    caps = [c for c in (limits.upload_bps, limits.download_bps) if c]
    return float(min(caps)) if caps else None


class PauseGate:
    """Blocks the training thread while ``should_hold()`` is true. ``hold`` runs the waiting (it
    reports the pause, waits, reports the resume); ``check`` is cheap when not paused."""

    def __init__(self, should_hold: Callable[[], bool], hold: Callable[[], None]):
        self.should_hold, self.hold = should_hold, hold
        self._holding = threading.Lock()
        self._handles: list = []
        self.holds = 0  # how many times a hook stopped training (for tests)

    def check(self) -> None:
        """Hold here while paused. Runs on the training thread or an autograd thread (backward)."""
        if self.should_hold() and self._holding.acquire(blocking=False):
            try:
                self.holds += 1
                self.hold()
            finally:
                self._holding.release()

    def attach(self, model) -> None:
        """Check the gate before every module's forward and at every parameter's gradient."""
        for module in model.modules():
            self._handles.append(module.register_forward_pre_hook(lambda _m, _args: self.check()))
        for param in model.parameters():
            if param.requires_grad:
                self._handles.append(param.register_hook(self._grad_hook))

    def _grad_hook(self, grad):
        self.check()
        return None

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
