"""``limits.training_below_helpers``: the worker's threads go to SCHED_IDLE once its helper
processes (DHT, averagers, p2pd) are forked, so an all-reduce gets the CPU before the training loop
that waits for it. Real processes and threads on one CPU; Linux only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")

PROBE = """
import json, os, sys, threading, time
from dedloc_core.engine import limits

os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one CPU for everyone: they contend
read, write = os.pipe()
helper = os.fork()
if helper == 0:  # a helper process (forked before the call, as hivemind's are): spins 1 s of wall time
    os.read(read, 1)
    began, cpu = time.monotonic(), time.process_time()
    while time.monotonic() - began < 1.0:
        pass
    os.write(write, json.dumps(time.process_time() - cpu).encode())
    os._exit(0)
commands = threading.Event()
channel = threading.Thread(target=commands.wait)  # a Python thread from before: the app's commands
channel.start()
changed = limits.training_below_helpers() if sys.argv[1] == "below" else 0
channel_idle = os.sched_getscheduler(channel.native_id) == os.SCHED_IDLE
commands.set()
stop = False
def spin():  # the training loop's compute
    while not stop:
        sum(range(1000))
loop = threading.Thread(target=spin)
loop.start()
time.sleep(0.2)
new_thread = os.sched_getscheduler(loop.native_id) == os.SCHED_IDLE  # started after the call: inherits it
os.write(write, b"x")
time.sleep(0.1)
share = json.loads(os.read(read, 64))
stop = True
loop.join()
os.waitpid(helper, 0)
print(json.dumps(dict(changed=changed, share=share, main=os.sched_getscheduler(0) == os.SCHED_IDLE,
                      new_thread=new_thread, channel_idle=channel_idle)))
"""


def probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_helper_process_gets_the_cpu_before_the_training_threads():
    got = probe("below")
    assert got["changed"] >= 1 and got["main"] and got["new_thread"], got
    assert not got["channel_idle"], got  # the thread that takes the app's pause keeps its priority
    assert got["share"] > 0.8, f"the helper got {got['share']:.2f} s of CPU in 1 s beside an idle-class loop"


def test_without_it_the_helper_shares_the_cpu_with_the_loop():
    got = probe("plain")
    assert not got["main"], got
    assert got["share"] < 0.7, f"the helper got {got['share']:.2f} s of CPU in 1 s beside a normal loop"
