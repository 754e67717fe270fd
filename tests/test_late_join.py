"""A peer that just loaded the swarm's state and is ready to step at once (the swarm is finishing its
step) begins no round for that step: its round was scheduled only just now, after the others'
rounds had formed their group, and could only join their rounds for the next step. It waits for
the swarm's next step number, keeping its samples (``swarm.RoundCountingOptimizer._sit_out_this_step``).
Real hivemind DHTs on loopback; the rest of the swarm is two progress trackers on two more DHTs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import os, sys, time
from functools import partial
import hivemind, torch
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils.crypto import RSAPrivateKey
from dedloc_core.engine import hivemind_patches, swarm
hivemind_patches.install()

def wait_for(what, check):
    deadline = time.monotonic() + 60
    while not check():
        if time.monotonic() > deadline:
            print(what, file=sys.stderr, flush=True)
            os._exit(3)  # not a hang in the DHTs' shutdown
        time.sleep(0.1)

run_id = "late_join_probe"
first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
other = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs())
third = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs())
model = torch.nn.Linear(4, 2)
opt = swarm.RoundCountingOptimizer(
    dht=first, run_id=run_id, params=model.parameters(), optimizer=partial(torch.optim.SGD, lr=0.1),
    target_batch_size=1000, batch_size_per_step=1, matchmaking_time=2.0, verbose=False,
    tracker_opts=dict(min_refresh_period=0.2, max_refresh_period=0.5, default_refresh_period=0.2))
if sys.argv[1] == "plain":  # hivemind's own step
    swarm.RoundCountingOptimizer._update_global_epoch = hivemind.Optimizer._update_global_epoch
opt.load_state_from_peers()  # nobody to load from: the swarm is at step 0
# each with its own key: the process-wide one would sign all records here as one peer's
swarm_rest = [ProgressTracker(dht=dht, prefix=run_id, target_batch_size=1000, private_key=RSAPrivateKey(), start=True)
              for dht in (other, third)]
for peer in swarm_rest:
    peer.report_local_progress(local_epoch=0, samples_accumulated=10)

def micro_batch():
    model(torch.randn(1, 4)).sum().backward()
    opt.step()

micro_batch()  # far from the step's end: our first samples, and our progress record
wait_for("the peers never met", lambda: opt.tracker.global_progress.num_peers == 3)
for peer in swarm_rest:
    peer.report_local_progress(local_epoch=0, samples_accumulated=500)  # the rest of the swarm nearly done
wait_for("the swarm's samples never reached the tracker", lambda: opt.tracker.ready_to_update_epoch)
micro_batch()  # ready at once, with a gradient round scheduled in this very call
began = opt.scheduled_grads is not None and opt.scheduled_grads.triggered
print("first step:", "round began" if began else "no round", opt.local_epoch)
if sys.argv[1] == "plain":
    sys.stdout.flush()
    os._exit(0)  # its round is still running: nothing to wait for
micro_batch()  # the swarm has not stepped yet: still no round
print("meanwhile:", opt.scheduled_grads, opt.scheduled_state, opt.local_epoch)
for peer in swarm_rest:
    with peer.pause_updates():
        peer.update_epoch(1)  # the swarm steps
wait_for("the swarm's step 1 never reached the tracker", lambda: opt.tracker.global_epoch == 1)
micro_batch()
print("after the swarm's step:", opt.local_epoch, opt.tracker.local_progress.samples_accumulated, opt.rounds_joined)
for peer in swarm_rest:
    peer.shutdown()
opt.shutdown()
for dht in (third, other, first):
    dht.shutdown()
"""


def probe(mode: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return [line for line in out.stdout.splitlines() if ":" in line]


def test_a_peer_that_joins_at_the_end_of_a_step_waits_for_the_next_one():
    lines = probe("patched")
    assert lines[0] == "first step: no round 0", lines
    assert lines[1] == "meanwhile: None None 0", lines  # nothing scheduled while it waits
    # the swarm's step number, the four micro-batches' samples kept for the next round, no round
    assert lines[2] == "after the swarm's step: 1 4 0", lines


def test_hivemind_alone_begins_a_round_scheduled_too_late_for_its_group():
    assert probe("plain")[0] == "first step: round began 1"  # the round begun, the step taken
