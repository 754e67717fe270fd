"""A peer that just loaded the swarm's state and sees the swarm one step further (it stepped during
the download) goes on from that step instead of downloading the whole state again
(``swarm.RoundCountingOptimizer._should_load_state_from_peers``). Real hivemind DHTs on loopback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import sys, time
from functools import partial
import hivemind, torch
from hivemind.optim.progress_tracker import ProgressTracker
from dedloc_core.engine import swarm
from tests.probes import FAST_TRACKER, two_dhts

run_id = "catch_up_probe"
first, other = two_dhts()
opt = swarm.RoundCountingOptimizer(
    dht=first, run_id=run_id, params=torch.nn.Linear(4, 2).parameters(), optimizer=partial(torch.optim.SGD, lr=0.1),
    target_batch_size=1000, batch_size_per_step=1, verbose=False,
    tracker_opts=FAST_TRACKER)
if sys.argv[1] == "plain":  # hivemind's own check
    swarm.RoundCountingOptimizer._should_load_state_from_peers = hivemind.Optimizer._should_load_state_from_peers
opt.load_state_from_peers()  # the swarm is at step 0 while we load
# meanwhile another peer reaches step 1: its tracker publishes the progress record that ours reads
tracker = ProgressTracker(dht=other, prefix=run_id, target_batch_size=1000, start=True)
tracker.report_local_progress(local_epoch=1, samples_accumulated=5)
deadline = time.monotonic() + 60
while not (opt.tracker.global_epoch == 1 and opt.tracker.fetched_global_progress_this_epoch.is_set()):
    assert time.monotonic() < deadline, "the swarm's step 1 never reached the tracker"
    time.sleep(0.1)
print(opt._should_load_state_from_peers(), opt.local_epoch)
tracker.shutdown()
opt.shutdown()
other.shutdown()
first.shutdown()
"""


def probe(mode: str) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_a_peer_that_just_loaded_the_state_takes_the_swarms_next_step_without_loading_again():
    assert probe("patched") == "False 1"


def test_hivemind_alone_loads_the_whole_state_again():
    assert probe("plain") == "True 0"
