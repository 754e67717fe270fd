"""``proctree``: stopping a process with everything it started."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from dedloc_core import proctree

# a parent that starts a child in its group, prints the child's pid, then waits (ignoring SIGTERM if asked)
TREE = """
import signal, subprocess, sys, time
if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
stay = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
child = subprocess.Popen([sys.executable, "-c", stay])
print(child.pid, flush=True)
time.sleep(60)
"""


def _tree(mode: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", TREE, mode], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    return proc, int(proc.stdout.readline())


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_stop_process_terminates_the_leader_and_kills_what_is_left_of_its_group():
    proc, child = _tree("polite")
    assert proctree.stop_process(proc, timeout=10) is proctree.StopResult.OK
    assert proc.returncode == -15 and _gone(child)
    assert proctree.stop_process(proc) is proctree.StopResult.NOT_RUNNING


def test_stop_process_kills_a_group_that_ignores_sigterm():
    proc, child = _tree("stubborn")
    began = time.monotonic()
    assert proctree.stop_process(proc, timeout=0.5) is proctree.StopResult.KILLED
    assert proc.returncode == -9 and _gone(child) and time.monotonic() - began < 10


def test_kill_group_finds_the_group_after_its_leader_is_gone():
    proc, child = _tree("polite")
    proc.terminate()
    proc.wait(10)
    assert not _gone(child) and [p.pid for p in proctree.group_members(proc.pid)] == [child]
    proctree.kill_group(proc.pid)
    assert _gone(child) and not proctree.signal_group(proc.pid, 0)


# in a process of its own: stop_children stops every child of the process that calls it
SPARING = """
import subprocess, sys
from dedloc_core import proctree
kept, stopped = (subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2))
proctree.stop_children(timeout=5, spare=lambda p: p.pid == kept.pid)
print(kept.poll() is None, stopped.poll() is None)
kept.kill()
"""


def test_stop_children_spares_what_it_is_told_to():
    out = subprocess.run([sys.executable, "-c", SPARING], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "False"], out.stderr
