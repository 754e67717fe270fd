"""hivemind_patches patch 6: tasks nobody keeps and the MPFutures they await survive garbage collection."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# As in hivemind's background loops: a task nobody keeps awaits a future only it holds (an MPFuture
# with its weak registry, or a plain asyncio future); the probe collects garbage, then resolves it.
PROBE = """
import asyncio, gc, sys, weakref
from hivemind.utils.mpfuture import MPFuture
if sys.argv[1] == "patched":
    from dedloc_core.engine import hivemind_patches
    hivemind_patches.install()

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
    out = subprocess.run([sys.executable, "-c", PROBE, mode, future], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.mark.parametrize("future", ["mpfuture", "asyncio"])
def test_an_awaiting_task_survives_garbage_collection_with_the_patch(future):
    assert probe("patched", future) == "completed"


@pytest.mark.parametrize("future", ["mpfuture", "asyncio"])
def test_without_the_patch_the_awaiting_task_is_lost(future):
    # the bug the patch exists for; if a new hivemind or Python fixes it, this fails and the patch can go
    assert probe("plain", future) == "lost"
