"""A paused peer leaves the swarm's count of peers and, back, counts itself in at once
(``swarm.SwarmTracker.withdraw``). Two real trackers, each with a key of its own, on two DHTs on loopback."""

from __future__ import annotations

import pytest
from probes import probe_json

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast

PROBE = """
import json, time
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils.crypto import RSAPrivateKey
from dedloc_core.engine import swarm
from tests.probes import FAST_TRACKER, two_dhts, until

first, other = two_dhts()
ours = swarm.SwarmTracker(dht=first, prefix="withdraw_probe", target_batch_size=1000,
                          private_key=RSAPrivateKey(), start=True, **FAST_TRACKER)
theirs = ProgressTracker(dht=other, prefix="withdraw_probe", target_batch_size=1000,
                         private_key=RSAPrivateKey(), start=True, **FAST_TRACKER)

try:
    for tracker in (ours, theirs):  # (hivemind publishes a peer's progress once it has samples)
        tracker.report_local_progress(local_epoch=0, samples_accumulated=1)
    until(lambda: ours.global_progress.num_peers == 2 and theirs.global_progress.num_peers == 2, "never two peers")
    ours.withdraw(True)
    until(lambda: theirs.global_progress.num_peers == 1, "the other peer still counts the withdrawn one")
    until(lambda: ours.global_progress.num_peers == 1, "the withdrawn peer's view never left it out")
    ours.shutdown_triggered.set()  # our tracker's thread stops (storing nothing): what follows is withdraw's doing
    ours.should_report_progress.set(); ours.global_state_updated.set()
    assert ours.shutdown_complete.wait(10), "our tracker's thread did not stop"
    read_while_out = first.get(ours.training_progress_key, latest=True).value  # our record: None
    ours.withdraw(False)
    back = ours.global_progress.num_peers  # at once, before our store could land
    reread = ours._parse_swarm_progress_data(read_while_out).num_peers  # a fetch that read our None record
    print(json.dumps(dict(back=back, reread=reread)))
finally:
    ours.shutdown(); theirs.shutdown(); first.shutdown(); other.shutdown()
"""


def test_a_peer_back_from_a_pause_counts_itself_among_the_peers_at_once():
    # Counted out while paused, then back: without the fix its view still said one peer (the other),
    # and beside one other volunteer it took its steps alone, unaveraged, 27 of them in 3 s.
    assert probe_json(PROBE) == {"back": 2, "reread": 2}
