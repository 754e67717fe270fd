"""A peer that steps faster than its tracker's report period is still published in the swarm's
progress records (``swarm._PacedEvent``): hivemind's reporter publishes only while this peer's
last report with samples in it is at most one epoch old. Real hivemind DHT on loopback."""

from __future__ import annotations

import pytest
from probes import run_probe

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast

PROBE = """
import time
import hivemind
from dedloc_core.engine import swarm

run_id = "progress_reports_probe"
dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
tracker = swarm.SwarmTracker(dht=dht, prefix=run_id, target_batch_size=10**6, report_period=1.0, start=True)
published = None
for epoch in range(1, 26):  # 0.3 s an epoch, as a lone peer with a small model and batch
    with tracker.pause_updates():
        tracker.update_epoch(epoch)  # what hivemind.Optimizer does at each step
    for batch in range(1, 11):
        time.sleep(0.03)  # a micro-batch's forward and backward
        tracker.report_local_progress(epoch, batch * 8)
    entry = dht.get(run_id + "_progress", latest=True)
    if entry is not None and isinstance(entry.value, dict) and entry.value:
        published = epoch
        break
print("published at epoch", published)
tracker.shutdown()
dht.shutdown()
"""


def test_a_peer_stepping_faster_than_the_report_period_is_published():
    out = run_probe(PROBE, timeout=180)
    last = out.splitlines()[-1]
    assert last.startswith("published at epoch ") and last != "published at epoch None", out[-2000:]
    assert int(last.split()[-1]) <= 5, last  # within a few epochs of its first, not by luck
