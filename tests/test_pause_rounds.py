"""A paused peer does not fail the round of the group it was in or about to join
(``RoundCountingOptimizer.leave_untriggered_rounds`` and ``serve_grouped_rounds``). Three real
optimizers with delayed updates on loopback, the third the group's only reducer (its declared
bandwidth): it pauses as ``Session._pause`` does, once its round for the next step looks for a
group, or once all three rounds are in one group; the other two then take two steps. Without the
two methods its round joins or stays in the group untriggered, and the others' round fails for want
of its reduction (``bench/scale.py``: one pause failed a round for 14 peers). ``no_rerun``'s rerun
is off here: it would mend that round too, a matchmaking later."""

from __future__ import annotations

import pytest
from probes import probe_json

pytestmark = pytest.mark.slow

PROBE = """
import json, sys, threading, time
import torch
from hivemind.averaging.control import AveragingStage
from hivemind.utils.crypto import RSAPrivateKey
from dedloc_core.engine import swarm
from dedloc_core.engine.hivemind_ext import no_rerun
from tests.probes import lone_optimizer, until

no_rerun.grant_rerun = lambda: False  # the pause alone: a rerun among the others would mend their round later

tracker_init = swarm.SwarmTracker.__init__  # trackers in one process share a key (one record): not here
swarm.SwarmTracker.__init__ = lambda self, *a, **kw: tracker_init(self, *a, private_key=RSAPrivateKey(), **kw)
fix = sys.argv[1] == "fix"
peers, stop, paused = [], threading.Event(), threading.Event()
for i in range(3):
    model = torch.nn.Linear(512, 512)  # 1 MB
    fields = dict(initial_peers=[str(m) for m in peers[0][0].get_visible_maddrs()]) if peers else {}
    bandwidth = 1000.0 if i == 2 else 1.0  # the third reduces everything: its pause matters every time
    dht, opt = lone_optimizer("pause_rounds", model, lr=0.01, overlap=True, target_batch_size=96,
                              bandwidth=bandwidth, **fields)
    peers.append((dht, opt, model))

def at(opt, stage):
    last = opt.scheduled_grads
    return last is not None and not last.triggered and last.stage == stage

def ready(peers):
    if sys.argv[2] == "grouped":  # one group of three, none triggered
        return all(at(p[1], AveragingStage.AWAITING_TRIGGER) for p in peers)
    return at(peers[2][1], AveragingStage.LOOKING_FOR_GROUP)

def train(i):
    dht, opt, model = peers[i]
    while not stop.is_set():
        if i == 2 and opt.local_epoch >= 3 and ready(peers):  # one group of three
            opt.tracker.withdraw(True)  # the user's pause, as Session._pause does it
            paused.set()
            print("paused at", [p[1].local_epoch for p in peers], time.time(), file=sys.stderr, flush=True)
            if fix:
                opt.leave_untriggered_rounds()
                while not stop.is_set():
                    opt.serve_grouped_rounds()
                    time.sleep(0.05)
            return
        loss = model(torch.randn(4, 512)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.02)

threads = [threading.Thread(target=train, args=(i,), daemon=True) for i in range(3)]
for t in threads:
    t.start()
until(paused.is_set, "the three were never in one group", timeout=120)
before = [(peers[i][1].rounds_joined, peers[i][1].rounds_failed) for i in (0, 1)]
start = peers[0][1].local_epoch
until(lambda: min(peers[i][1].local_epoch for i in (0, 1)) >= start + 2, "the two left took no 2 steps", timeout=120)
# a delayed round ends after its step: wait until each of the two has one ended, or one failed
until(lambda: all(peers[i][1].rounds_joined + peers[i][1].rounds_failed > before[j][0] + before[j][1]
                  for j, i in enumerate((0, 1))), "the two ended no round", timeout=120)
stop.set()
result = {"joined": [peers[i][1].rounds_joined - before[j][0] for j, i in enumerate((0, 1))],
          "failed": [peers[i][1].rounds_failed - before[j][1] for j, i in enumerate((0, 1))]}
for t in threads:  # a thread still in opt.step() could wait for ever on an averager shut down under it
    t.join(timeout=60)  # (its last round may fail as the others stop: counted above, before it)
print(json.dumps(result))
for dht, opt, _ in peers:
    opt.shutdown(); dht.shutdown()
"""


@pytest.mark.parametrize("stage", ["looking", "grouped"])
def test_a_paused_peer_leaves_or_serves_its_round_and_the_others_average(stage):
    result = probe_json(PROBE, "fix", stage, timeout=300)
    assert result["failed"] == [0, 0] and min(result["joined"]) >= 1, result


@pytest.mark.parametrize("stage", ["looking", "grouped"])
def test_without_it_the_others_round_fails(stage):  # the test above is one that could fail
    result = probe_json(PROBE, "plain", stage, timeout=300)
    # a failed round of either shows it: the probe stops once each has ended a round, and the second's
    # may have been one it averaged with the first before the paused peer's matchmaking found them
    assert max(result["failed"]) >= 1, result
