"""``limits.training_below_helpers``: the worker's threads go to SCHED_IDLE once its helper
processes (DHT, averagers, p2pd) are forked, so an all-reduce gets the CPU before the training loop
that waits for it. Real processes and threads on one CPU; Linux only."""

from __future__ import annotations

import os

import pytest
from probes import probe_json, run_probe

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")]

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
    return probe_json(PROBE, mode, timeout=60)


def test_a_helper_process_gets_the_cpu_before_the_training_threads():
    got = probe("below")
    assert got["changed"] >= 1 and got["main"] and got["new_thread"], got
    assert not got["channel_idle"], got  # the thread that takes the app's pause keeps its priority
    assert got["share"] > 0.8, f"the helper got {got['share']:.2f} s of CPU in 1 s beside an idle-class loop"


def test_without_it_the_helper_shares_the_cpu_with_the_loop():
    got = probe("plain")
    assert not got["main"], got
    assert got["share"] < 0.7, f"the helper got {got['share']:.2f} s of CPU in 1 s beside a normal loop"



REJOIN = """
import json, os, sys
from dedloc_core.engine import hivemind_ext, limits

hivemind_ext.install(skip=sys.argv[1:])
import hivemind

def fork_class():  # a process forked from the calling thread: its scheduling class
    read, write = os.pipe()
    if os.fork() == 0:
        os.write(write, str(os.sched_getscheduler(0)).encode())
        os._exit(0)
    os.wait()
    return int(os.read(read, 8))

first = hivemind.DHT(start=True)  # the first session's helpers, then its loop goes idle
limits.training_below_helpers()
second = hivemind.DHT(start=True, initial_peers=first.get_visible_maddrs())  # a rejoin's
got = dict(first=os.sched_getscheduler(first.pid), second=os.sched_getscheduler(second.pid),
           direct=fork_class(), idle=os.SCHED_IDLE)
second.shutdown()
first.shutdown()
print(json.dumps(got))
"""


def test_a_rejoins_helpers_are_forked_above_the_idle_loop():
    """A second session in the worker (a rejoin after a lost relay) starts its DHT and averagers
    from the idle loop's thread; hivemind_ext forks them above it (``limits.above_the_loop``)."""
    got = probe_json(REJOIN)
    assert got["direct"] == got["idle"], got  # a plain fork from the loop's thread: the loop's class
    assert got["first"] != got["idle"] and got["second"] != got["idle"], got


def test_without_fork_above_loop_a_rejoins_helpers_run_at_the_loops_idle_class():
    got = probe_json(REJOIN, "fork_above_loop")
    assert got["first"] != got["idle"] and got["second"] == got["idle"], got


FORKED = """
import os, signal
from dedloc_core.engine import limits
limits.above_the_loop(int)  # the launcher's thread exists
child = os.fork()  # from another thread than the launcher: the child has no launcher thread
if child == 0:
    signal.alarm(10)  # a submit to the parent's pool would wait forever
    os._exit(0 if limits.above_the_loop(os.getpid) == os.getpid() else 1)
_, status = os.waitpid(child, 0)
print(os.waitstatus_to_exitcode(status))
"""


def test_a_process_forked_after_the_launcher_gets_its_own():
    out = run_probe(FORKED, timeout=60)
    assert out.split()[-1] == "0", out  # -14: the child hung until its alarm
