"""A gradient round in a large swarm looks for its group longer before the step ends
(``swarm.matchmaking_window``), and still closes its group at the step's end. Its effect at scale
(64 peers: one to four groups and 8 of 9 rounds averaged, against groups of 2 to 23 and a peer
left alone in half the rounds) is measured by ``bench/scale_averaging.py``, not here."""

from __future__ import annotations

import pytest
from probes import probe_json

from dedloc_core.engine.swarm import MATCHMAKING_MOST, matchmaking_window

PROBE = """
import json, threading, time
import torch
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from dedloc_core.engine import swarm
from tests.probes import lone_optimizer, until

swarm.MATCHMAKING_PER_PEER = 2.0  # two peers stand for a large swarm: a 4 s window
tracker_init = swarm.SwarmTracker.__init__  # trackers in one process share a key (one record): not here
swarm.SwarmTracker.__init__ = lambda self, *a, **kw: tracker_init(self, *a, private_key=RSAPrivateKey(), **kw)
peers, leads, stop = [], [], threading.Event()
for i in range(2):
    model = torch.nn.Linear(64, 64)
    fields = dict(initial_peers=[str(m) for m in peers[0][0].get_visible_maddrs()]) if peers else {}
    dht, opt = lone_optimizer("window", model, lr=0.01, overlap=True, target_batch_size=800,
                              averaging_timeout=30.0, **fields)
    schedule = opt.grad_averager.schedule_step
    def timed(*args, _schedule=schedule, **kwargs):
        control = _schedule(*args, **kwargs)
        leads.append(control.scheduled_time - get_dht_time())
        return control
    opt.grad_averager.schedule_step = timed
    peers.append((dht, opt, model))

def train(i):
    dht, opt, model = peers[i]
    while not stop.is_set():
        model(torch.randn(4, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.05)

threads = [threading.Thread(target=train, args=(i,), daemon=True) for i in range(2)]
for t in threads:
    t.start()
until(lambda: min(p[1].local_epoch for p in peers) >= 4, "the two took no 4 steps", timeout=150)
stop.set()
for t in threads:
    t.join(timeout=30)
print(json.dumps({"leads": leads, "joined": [p[1].rounds_joined for p in peers],
                  "failed": [p[1].rounds_failed for p in peers]}))
for dht, opt, _ in peers:
    opt.shutdown(); dht.shutdown()
"""


@pytest.mark.slow
def test_a_round_looks_for_its_group_the_window_ahead_and_averages():
    result = probe_json(PROBE, timeout=240)
    # hivemind's own round begins the matchmaking time (0.5 s) before its group closes
    assert max(result["leads"]) > 2.5, result
    assert min(result["joined"]) >= 2 and result["failed"] == [0, 0], result


def test_the_window_grows_with_the_swarm_within_its_bounds():
    assert matchmaking_window(16, 3.0, 30.0) == 3.0  # a small swarm: the catalog's matchmaking time
    assert matchmaking_window(64, 3.0, 30.0) == 8.0
    assert matchmaking_window(1000, 3.0, 60.0) == MATCHMAKING_MOST
    assert matchmaking_window(1000, 3.0, 30.0) == 10.0  # a third of the averaging timeout
    assert matchmaking_window(1000, 12.0, 30.0) == 12.0  # never below the catalog's
