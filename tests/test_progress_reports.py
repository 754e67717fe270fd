"""A peer that steps faster than its tracker's report period is still published in the swarm's
progress records (``swarm._PacedEvent``): hivemind's reporter publishes only while this peer's
last report with samples in it is at most one epoch old. Real hivemind DHT on loopback."""

from __future__ import annotations

from probes import probe_json, run_probe

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



FETCHES = """
import json, time
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from dedloc_core.engine import swarm
from tests.probes import two_dhts

run_id = "fetch_probe"
first, other = two_dhts()
reads = {"ours": [], "hivemind": []}
def counted(dht, name):
    get = dht.get
    def counting_get(key, *args, **kwargs):  # the tracker's reads of the swarm's progress
        if key == run_id + "_progress":
            reads[name].append(get_dht_time())
        return get(key, *args, **kwargs)
    dht.get = counting_get
counted(first, "ours")
counted(other, "hivemind")
target = 4000  # two peers at about 100 samples/s each: the step's target about 20 s after they begin
opts = dict(prefix=run_id, target_batch_size=target, report_period=1.0, start=True, min_refresh_period=0.5,
            max_refresh_period=10)
# (each its own key: the trackers of one process would otherwise publish under one subkey, one peer)
ours = swarm.SwarmTracker(dht=first, fetch_lead=3.0, private_key=RSAPrivateKey(), **opts)
theirs = swarm.SwarmTracker(dht=other, private_key=RSAPrivateKey(), **opts)  # hivemind's reads
began, samples = get_dht_time(), 0
while 2 * samples < target:
    time.sleep(0.1)
    samples += 10
    ours.report_local_progress(0, samples)
    theirs.report_local_progress(0, samples)
reached = get_dht_time()
print(json.dumps({name: [round(t - reached, 2) for t in times if began + 2 < t <= reached]
                  for name, times in reads.items()}))
ours.shutdown(); theirs.shutdown(); first.shutdown(); other.shutdown()
"""


def test_the_tracker_reads_the_swarm_just_before_the_round_is_scheduled_and_not_every_half_of_the_time_left():
    """``SwarmTracker.fetch_lead``: a read lands ``fetch_lead`` seconds before the step's ETA (so the
    round pre-scheduled ``matchmaking_time`` before it is scheduled on a fresh ETA), and none after it
    until the step should have come; a step of 20 s costs three reads of the swarm's progress (each a
    DHT search on every node). hivemind's reads come every half of the time left or so, the more
    often the nearer the step. Two peers, one of each, on loopback (the first 2 s left out: their
    records come in then)."""
    reads = probe_json(FETCHES, timeout=180)
    ours, hivemind = reads["ours"], reads["hivemind"]
    assert 1 <= len(ours) <= 3, reads
    assert any(-4.0 <= t <= -2.5 for t in ours), reads  # the read the round is scheduled on
    assert not any(-2.0 < t for t in ours), reads  # none after it: the round's group decides the step
    assert len(hivemind) >= len(ours) + 2 and any(-2.0 < t for t in hivemind), reads
