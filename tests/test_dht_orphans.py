"""hivemind_ext.dht_orphans: a request whose caller has exited does not stall the DHT. A call to
the DHT carries an ``MPFuture`` whose file descriptors the DHT fetches from the caller's process
while it unpickles the message; hivemind's DHT slept 3 s when that failed, so its own shutdown
right after ran past its grace: the DHT was killed and left its socket files (and its p2pd).
A real DHT and p2pd on loopback, in a fresh interpreter, its sockets under ``tmp_path``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import multiprocessing as mp, pathlib, sys
from multiprocessing.reduction import ForkingPickler
import hivemind
from hivemind.p2p import P2P
from hivemind.utils.mpfuture import MPFuture
from dedloc_core.engine import hivemind_ext
hivemind_ext.install(skip=() if sys.argv[1] == "all" else sys.argv[1].split(","))
P2P._UNIX_SOCKET_PREFIX = "/unix" + sys.argv[2] + "/hivemind-"

def caller(conn):  # pickles a get() as DHT.get does, hands the bytes over and exits
    request = ("_get", [], dict(key="k", latest=False, future=MPFuture()))
    conn.send_bytes(bytes(ForkingPickler.dumps(request)))

dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], shutdown_timeout=2.0)
ours, theirs = mp.Pipe()
child = mp.get_context("fork").Process(target=caller, args=(theirs,))
child.start()
data = ours.recv_bytes()
child.join()
dht._outer_pipe.send_bytes(data)  # the request of a process that has gone
dht.shutdown()
print("left", sorted(p.name for p in pathlib.Path(sys.argv[2]).iterdir()))
"""


HARD_WAY = "DHT did not shut down within the grace period"  # hivemind's DHT.shutdown


def run_probe(mode: str, where: Path) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", PROBE, mode, str(where)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_the_dht_drops_a_request_from_a_process_that_has_gone(tmp_path):
    out = run_probe("all", tmp_path)
    assert HARD_WAY not in out.stderr, out.stderr[-3000:]
    assert "left []" in out.stdout, out.stdout


def test_without_the_patch_the_dht_stalls_past_its_shutdown_grace(tmp_path):
    out = run_probe("dht_orphans", tmp_path)
    assert HARD_WAY in out.stderr, out.stderr[-3000:]
    assert "hivemind-p2pd-" in out.stdout, out.stdout
