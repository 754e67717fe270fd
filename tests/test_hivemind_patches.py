"""hivemind_patches patch 6: an MPFuture that a coroutine awaits is not garbage-collected mid-await."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# As in hivemind's averager loop: a task nobody keeps awaits an MPFuture nobody else keeps.
PROBE = """
import asyncio, gc, sys, weakref
from hivemind.utils.mpfuture import MPFuture
if sys.argv[1] == "patched":
    from dedloc_core import hivemind_patches
    hivemind_patches.install()

async def main():
    done = asyncio.Event()
    async def waiter(fut):
        await fut
        done.set()
    fut = MPFuture()
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


def probe(mode: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_an_awaited_mpfuture_survives_garbage_collection_with_the_patch():
    assert probe("patched") == "completed"


def test_without_the_patch_hivemind_loses_the_awaiting_task():
    # the bug the patch exists for; if a new hivemind fixes it, this fails and the patch can go
    assert probe("plain") == "lost"
