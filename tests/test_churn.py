"""Churn on loopback: a backbone and five volunteers; once the swarm steps, one volunteer is killed
(SIGKILL, a laptop lid), one leaves cleanly, one pauses and a newcomer joins, all within seconds.
The swarm goes on stepping, the newcomer catches up and averages, the paused one comes back and
averages again, and every volunteer's samples add up: what the app records (``StatsRecorder`` into
a real SQLite file) is what the worker computed less what state loads dropped, and the backbone's
leaderboard credits no volunteer more than that. ``bench/scale.py`` runs the same with sixteen."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest
from conftest import start_command, tiny_experiment
from swarmpeer import SwarmPeer, start_backbone, wait_until

from dedloc_core.protocol import Pause, Resume
from dedloc_core.stats.db import StatsStore
from dedloc_core.stats.recorder import StatsRecorder

pytestmark = pytest.mark.slow

EXP = dict(target_batch_size=384, matchmaking_time=1.5, averaging_timeout=15.0)


class Volunteer(SwarmPeer):
    """A worker whose stats events go to the app's recorder, in order, as the app's supervisor does."""

    def __init__(self, worker, recorder: StatsRecorder):
        super().__init__(worker)
        self.recorder, self.fed = recorder, 0

    def drain(self) -> None:
        super().drain()
        for event in self.all_stats[self.fed:]:
            self.recorder.on_event(event)
        self.fed = len(self.all_stats)

    @property
    def peer_id(self) -> str:
        return next(s.peer_id for s in self.states if s.peer_id)


def test_a_swarm_under_churn_keeps_stepping_and_counts_every_sample_once(spawn_worker, corpus_server, tmp_path):
    experiment = tiny_experiment(**EXP)
    backbone, ready, _ = start_backbone(experiment, tmp_path / "bb", http=True)

    def join(name: str, seed: int) -> Volunteer:
        worker = spawn_worker(name)
        recorder = StatsRecorder(worker.home / "stats.db", experiment["id"])
        worker.send(start_command(corpus_server, worker.home, initial_peers=ready["maddrs"], seed=seed, **EXP))
        return Volunteer(worker, recorder)

    crowd = [join(f"v{i}", i + 1) for i in range(5)]
    wait_until(crowd, lambda: all(p.progress for p in crowd) and min(p.step for p in crowd) >= 2, 300,
               "the five volunteers did not take two steps together")
    killed, leaving, pausing, *staying = crowd
    killed.worker.kill()
    leave = threading.Thread(target=leaving.worker.stop, kwargs={"timeout": 15})
    leave.start()
    pausing.worker.send(Pause(reason="user"))
    newcomer = join("new", 9)
    at_churn = max(p.step for p in crowd)
    live = [*staying, newcomer]
    wait_until([*live, pausing], lambda: newcomer.stats is not None and newcomer.stats.rounds >= 1
               and min(p.step for p in live) >= at_churn + 3, 300,
               "the swarm did not take three steps with its newcomer after the churn")
    leave.join()
    assert not killed.worker.running() and not leaving.worker.running()

    rounds_before = pausing.rounds
    pausing.worker.send(Resume())
    back = [*live, pausing]
    step = max(p.step for p in live)
    wait_until(back, lambda: pausing.step >= step + 1 and pausing.rounds > rounds_before, 240,
               "the volunteer back from its pause did not average again")

    # every sample once: the app records what the worker computed less what state loads dropped
    # (never less than it recorded before: a drop after a report comes off later samples), and the
    # swarm credits no more than that
    for p in crowd + [newcomer]:
        p.drain()
        if p is killed or p is leaving:
            p.recorder.on_event(None)
        p.recorder.flush()
    with urllib.request.urlopen(backbone.http_url + "swarm.json", timeout=30) as response:
        board = {c["peer_id"]: c["samples"] for c in json.loads(response.read())["leaderboard"]}
    for p in crowd + [newcomer]:
        counted = max(s.samples - s.samples_dropped for s in p.all_stats)
        recorded = StatsStore(p.worker.home / "stats.db").totals().samples
        assert recorded == counted > 0, (p.peer_id, counted, recorded)
        assert board.get(p.peer_id, 0) <= recorded, (p.peer_id, board.get(p.peer_id), recorded)
    assert all(board.get(p.peer_id, 0) > 0 for p in staying), board
    backbone.stop()
