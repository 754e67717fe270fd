"""Upload and download caps enforced on this peer's p2p traffic: two token buckets in shared
memory, so the worker and the DHT and averager processes that hivemind forks from it draw
from the same budget. ``hivemind_ext.bandwidth_caps`` makes
every p2p stream read and write and every unary call ``await take_up(n)`` /
``await take_down(n)`` first. Reading slower lets the stream's buffers fill, so TCP (through
p2pd's yamux flow control) slows the remote sender down too.

A bucket lends: ``take`` may drive the balance below zero, and the caller then sleeps until the
debt is paid at the capped rate. So concurrent takers are served in order, and a long message is
paced chunk by chunk. A rate of 0 means "no cap"; caps can change at any time from any process.

Call ``setup()`` before the first fork (``hivemind_ext.install`` does); ``set_caps`` then.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from typing import Any

CHUNK = 1 << 16  # bytes paced per step (hivemind writes streams in 64 KiB chunks)
BURST_SECONDS = 0.1  # a bucket holds at most this many seconds of traffic (and one CHUNK)

_state: Any = None  # RawArray('d', 6): [rate, balance, last refill] for up, then for down
_lock: Any = None
UP, DOWN = 0, 3


def setup() -> None:
    global _state, _lock
    if _state is None:
        _state = mp.RawArray("d", 6)
        _lock = mp.Lock()


def set_caps(upload_bps: int | None, download_bps: int | None) -> None:
    """Set the caps in bytes per second (None leaves a cap unchanged, 0 removes it)."""
    setup()
    for base, rate in ((UP, upload_bps), (DOWN, download_bps)):
        if rate is None:
            continue
        with _lock:
            _state[base] = float(rate)
            _state[base + 1] = _burst(rate)
            _state[base + 2] = time.monotonic()


def caps() -> tuple[int, int]:
    if _state is None:
        return 0, 0
    return int(_state[UP]), int(_state[DOWN])


def _burst(rate: float) -> float:
    return max(float(CHUNK), rate * BURST_SECONDS)


def reserve(base: int, n: int, now: float | None = None) -> float:
    """Take ``n`` bytes from a bucket; return how long to wait before using them (0: at once)."""
    if _state is None or _state[base] <= 0 or n <= 0:
        return 0.0
    if not _lock.acquire(timeout=0.5):  # a dead holder must not stall traffic: wait as if in line
        return n / max(_state[base], 1.0)
    try:
        rate = _state[base]
        if rate <= 0:
            return 0.0
        now = time.monotonic() if now is None else now
        balance = min(_burst(rate), _state[base + 1] + (now - _state[base + 2]) * rate) - n
        _state[base + 1], _state[base + 2] = balance, now
        return 0.0 if balance >= 0 else -balance / rate
    finally:
        _lock.release()


async def _take(base: int, n: int) -> None:
    # pace in chunks, so one large message cannot borrow far ahead of a later change of cap
    while n > 0:
        step = min(n, CHUNK)
        n -= step
        delay = reserve(base, step)
        if delay > 0:
            await asyncio.sleep(delay)


async def take_up(n: int) -> None:
    await _take(UP, n)


async def take_down(n: int) -> None:
    await _take(DOWN, n)


def active(base: int) -> bool:
    return _state is not None and _state[base] > 0
