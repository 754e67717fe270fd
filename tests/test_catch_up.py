"""A peer that just loaded the swarm's state and sees the swarm further on (it stepped during the
download) goes on from the swarm's step instead of downloading the whole state again
(``swarm.RoundCountingOptimizer.load_state_from_peers`` and ``_should_load_state_from_peers``): a
second download would last as long and find the swarm as far ahead. A state older than the swarm was
when the download began is loaded again, as hivemind does. Real hivemind DHTs on loopback."""

from __future__ import annotations

import pytest
from probes import run_probe

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast

PROBE = """
import sys, time
from functools import partial
import hivemind, torch
from hivemind.optim.progress_tracker import ProgressTracker
from dedloc_core.engine import swarm
from tests.probes import FAST_TRACKER, two_dhts

mode, ahead = sys.argv[1], int(sys.argv[2])
run_id = "catch_up_probe"
first, other = two_dhts()
opt = swarm.RoundCountingOptimizer(
    dht=first, run_id=run_id, params=torch.nn.Linear(4, 2).parameters(), optimizer=partial(torch.optim.SGD, lr=0.1),
    target_batch_size=1000, batch_size_per_step=1, verbose=False,
    tracker_opts=FAST_TRACKER)
if mode == "plain":  # hivemind's own load and check
    swarm.RoundCountingOptimizer.load_state_from_peers = hivemind.Optimizer.load_state_from_peers
    swarm.RoundCountingOptimizer._should_load_state_from_peers = hivemind.Optimizer._should_load_state_from_peers
tracker = ProgressTracker(dht=other, prefix=run_id, target_batch_size=1000, start=True)  # another peer's


def swarm_at(epoch):
    # the other peer reaches ``epoch``: its tracker publishes the record, until a DHT read sees it
    tracker.report_local_progress(local_epoch=epoch, samples_accumulated=5)
    deadline = time.monotonic() + 60
    while True:
        found = first.get(opt.tracker.training_progress_key, latest=True)
        if found is not None and opt.tracker._parse_swarm_progress_data(found.value).epoch == epoch:
            return
        assert time.monotonic() < deadline, "the other peer's step never reached the DHT"
        time.sleep(0.1)


def wait_for_tracker(epoch):
    deadline = time.monotonic() + 60
    while not (opt.tracker.global_epoch == epoch and opt.tracker.fetched_global_progress_this_epoch.is_set()):
        assert time.monotonic() < deadline, "the swarm's step never reached the tracker"
        time.sleep(0.1)


if mode == "stale-state":  # the swarm is already ahead when we begin, and the state served is older
    swarm_at(ahead)
    wait_for_tracker(ahead)
elif mode == "after":  # the swarm steps just after the download and our look at it
    opt.load_state_from_peers()
    swarm_at(ahead)
else:  # the swarm steps while the download lasts (no peer serves a state here: we stay at step 0)
    download = opt.state_averager.load_state_from_peers
    def slow_download(**kwargs):
        swarm_at(ahead)
        return download(**kwargs)
    opt.state_averager.load_state_from_peers = slow_download
if mode != "after":
    opt.load_state_from_peers()
wait_for_tracker(ahead)
print(opt._should_load_state_from_peers(), opt.local_epoch)
tracker.shutdown()
opt.shutdown()
other.shutdown()
first.shutdown()
"""


def probe(mode: str, ahead: int) -> str:
    return run_probe(PROBE, mode, str(ahead), timeout=180).splitlines()[-1]


def test_a_peer_that_just_loaded_the_state_takes_the_swarms_next_step_without_loading_again():
    assert probe("patched", 1) == "False 1"


def test_a_peer_whose_swarm_steps_just_after_the_load_takes_that_step_without_loading_again():
    # (the strict check at the tracker's first read after the load: _should_load_state_from_peers)
    assert probe("after", 1) == "False 1"


def test_a_peer_the_swarm_outpaced_by_steps_during_its_download_goes_on_from_the_swarms_step():
    assert probe("patched", 3) == "False 3"


def test_hivemind_alone_loads_the_whole_state_again():
    assert probe("plain", 1) == "True 0"
    assert probe("plain", 3) == "True 0"


def test_a_state_older_than_the_swarm_was_when_the_download_began_is_loaded_again():
    assert probe("stale-state", 3) == "True 0"
