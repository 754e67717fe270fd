"""hivemind_patches patch 6: tasks nobody keeps and the MPFutures they await survive garbage collection;
patch 9: an averager renews its state record before the record expires."""

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


# Patch 9: an averager's "I share my state" record, read from another peer's DHT every 50 ms for
# three lifetimes (2 s each). Prints the least time the old record had left when a renewal was
# seen, and how often the record was missing after it first appeared.
RECORDS = """
import sys, time
import torch, hivemind
from hivemind.averaging import DecentralizedAverager
from hivemind.utils import get_dht_time
if sys.argv[1] == "patched":
    from dedloc_core.engine import hivemind_patches
    hivemind_patches.install()
first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
second = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs())
averager = DecentralizedAverager([torch.zeros(4)], first, prefix="records", start=True, declare_state_period=2.0)
subkey = averager.peer_id.to_bytes()
last, least, missing = None, float("inf"), 0
end = time.monotonic() + 6.5
while time.monotonic() < end:
    found = second.get("records.all_averagers", latest=True)
    record = found.value.get(subkey) if found is not None else None
    now = get_dht_time()
    if record is None:
        missing += last is not None
    elif last is not None and record.expiration_time > last:
        least = min(least, last - now)
    if record is not None:
        last = record.expiration_time
    time.sleep(0.05)
print(f"{least:.3f} {missing}")
averager.shutdown(); second.shutdown(); first.shutdown()
"""


def renewals(mode: str) -> tuple[float, int]:
    out = subprocess.run([sys.executable, "-c", RECORDS, mode], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    least, missing = out.stdout.split()
    return float(least), int(missing)


def test_a_state_record_is_renewed_while_it_still_has_half_its_life():
    least, missing = renewals("patched")
    assert least >= 0.7, f"a renewal came {least:.3f} s before the old record expired (half a life is 1 s)"
    assert missing == 0


def test_without_the_patch_a_state_record_is_renewed_only_as_it_expires():
    least, _ = renewals("plain")
    assert least < 0.3, least
