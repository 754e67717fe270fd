"""hivemind_ext.helper_threads, a switch: by default the DHT and the averagers stay
forked processes; ``DEDLOC_HELPER_THREADS=dht`` makes the DHT a thread of the process, ``all`` the
averagers too; two peers still average, and a future settled through its copy on a pipe reaches
its original. Each probe is a fresh process, with every extension and without this one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast

ROOT = Path(__file__).resolve().parents[1]

AVERAGE = """
import json, sys, psutil, torch, hivemind
from dedloc_core.engine import hivemind_ext
hivemind_ext.install(skip=() if sys.argv[1] == "all" else sys.argv[1].split(","))
first = hivemind.DHT(start=True)
second = hivemind.DHT(initial_peers=first.get_visible_maddrs(), start=True)
kw = dict(prefix="probe", target_group_size=2, min_group_size=2, min_matchmaking_time=1.0, start=True)
a = hivemind.averaging.DecentralizedAverager([torch.full((8,), 1.0)], first, **kw)
b = hivemind.averaging.DecentralizedAverager([torch.full((8,), 3.0)], second, **kw)
helpers = [c.name() for c in psutil.Process().children(recursive=True) if c.name().startswith("python")]
steps = [a.step(wait=False, timeout=30), b.step(wait=False, timeout=30)]
groups = [len(s.result(60) or {}) for s in steps]
with a.get_tensors() as ta, b.get_tensors() as tb:
    averaged = [ta[0].tolist(), tb[0].tolist()]
for x in (a, b, first, second):
    x.shutdown()
print(json.dumps(dict(helpers=helpers, groups=groups, averaged=averaged)))
"""

COPY = """
import asyncio, gc, pickle, sys, threading
from multiprocessing.reduction import ForkingPickler
from hivemind.utils.mpfuture import MPFuture
from dedloc_core.engine import hivemind_ext
hivemind_ext.install(skip=() if sys.argv[1] == "all" else sys.argv[1].split(","))
future = MPFuture()
copy = pickle.loads(ForkingPickler.dumps(future))  # what a helper thread gets through a pipe
other = pickle.loads(ForkingPickler.dumps(future))
del other  # a copy dropped first (hivemind's __del__ unregistered the original)
gc.collect()
errors = []
def helper():  # a helper thread runs an event loop, as the DHT's and the averagers' threads do
    async def settle():
        try:
            copy.set_result([1, 2, 3])
        except Exception as exc:
            errors.append(repr(exc))
    asyncio.run(settle())
thread = threading.Thread(target=helper)
thread.start()
thread.join()
try:
    print(repr(future.result(timeout=5)), errors)
except Exception as exc:
    print("failed", repr(exc), errors)
"""


def probe(script: str, mode: str, threads: str | None = "dht") -> str:
    env = {key: value for key, value in os.environ.items() if key != "DEDLOC_HELPER_THREADS"}
    if threads is not None:
        env["DEDLOC_HELPER_THREADS"] = threads
    out = subprocess.run([sys.executable, "-c", script, mode], cwd=ROOT, capture_output=True, text=True, timeout=180,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_the_dhts_are_threads_and_the_averagers_processes_that_still_average():
    got = json.loads(probe(AVERAGE, "all"))
    assert len(got["helpers"]) == 2, got  # the two averagers; no forked DHT
    assert got["groups"] == [2, 2], got
    assert got["averaged"] == [[2.0] * 8, [2.0] * 8], got


def test_with_all_the_averagers_are_threads_too_and_still_average():
    got = json.loads(probe(AVERAGE, "all", threads="all"))
    assert got["helpers"] == [], got  # no forked DHT or averager process
    assert got["groups"] == [2, 2], got
    assert got["averaged"] == [[2.0] * 8, [2.0] * 8], got


def test_by_default_they_stay_forked_processes_with_the_patches():
    got = json.loads(probe(AVERAGE, "all", threads=None))
    assert len(got["helpers"]) == 4, got  # two DHTs, two averagers: the switch is off by default
    assert got["averaged"] == [[2.0] * 8, [2.0] * 8], got


def test_without_the_patch_they_are_forked_processes():
    got = json.loads(probe(AVERAGE, "helper_threads"))
    assert len(got["helpers"]) == 4, got  # two DHTs, two averagers
    assert got["averaged"] == [[2.0] * 8, [2.0] * 8], got


def test_a_future_settled_through_its_copy_reaches_the_original():
    assert probe(COPY, "all") == "[1, 2, 3] []"


def test_without_the_patch_the_original_never_gets_the_result():
    assert probe(COPY, "helper_threads") != "[1, 2, 3] []"
