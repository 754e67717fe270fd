"""The swarm summary: leaderboard sums over worker sessions, rebuilt from the backbone's files,
served over real HTTP and validated on the way in."""

from __future__ import annotations

import json
import time

import pytest

from dedloc_core.organizer.backbone import Recorder
from dedloc_core.organizer.httpserve import FileServer, bearer_token
from dedloc_core.stats.swarmview import ANONYMOUS, SwarmUnavailable, SwarmView, fetch_summary, parse_summary


class Peer:
    def __init__(self, peer_id, samples, name="", loss=3.0, t=1000.0):
        self.peer_id, self.samples, self.display_name, self.loss, self.time = peer_id, samples, name, loss, t
        self.step, self.compute_seconds, self.samples_per_second = 1, samples / 100, 12.5


def test_leaderboard_adds_up_worker_sessions_and_survives_a_backbone_restart(tmp_path):
    view = SwarmView("run")
    rec = Recorder(tmp_path, view)
    rec.record(1, 2, [Peer("QmAlice1234567890", 100, "Alice"), Peer("QmBob1234567890", 40)])
    rec.record(2, 2, [Peer("QmAlice1234567890", 300, "Alice"), Peer("QmBob1234567890", 90)])
    rec.record(3, 2, [Peer("QmAlice1234567890", 50, "Alice"), Peer("QmBob1234567890", 90)])  # Alice restarted
    summary = view.summary(now=1001.0)
    assert [(c.name, c.samples, c.active) for c in summary.leaderboard] == [
        ("Alice", 350, True), ("…34567890", 90, True)]
    assert (summary.global_step, summary.num_peers, summary.samples_per_second) == (3, 2, 25.0)
    assert [p.step for p in summary.learning_curve] == [1, 2, 3]
    again = SwarmView.load(tmp_path, "run").summary(now=time.time() + 1000)  # csv times: when recorded
    assert [(c.name, c.samples, c.active) for c in again.leaderboard] == [
        ("Alice", 350, False), ("…34567890", 90, False)]
    assert [p.step for p in again.learning_curve] == [1, 2, 3]


def test_files_cut_by_a_crash_still_load(tmp_path):
    (tmp_path / "learning_curve.jsonl").write_text('{"time": 1, "step": 1, "loss": 2.0}\n{"time": 2, "st')
    (tmp_path / "contributions.csv").write_text(
        "time,peer_id,display_name,step,samples,compute_seconds,loss\n1,QmX,,1,10,1.0,2.0\n2,QmX,,1,oops")
    summary = SwarmView.load(tmp_path).summary()
    assert [p.step for p in summary.learning_curve] == [1]
    assert [c.samples for c in summary.leaderboard] == [10]


def test_summary_over_http_and_bad_documents():
    view = SwarmView("run")
    view.add_point({"time": 1.0, "step": 4, "loss": 1.5, "samples_per_second": 7.0, "num_peers": 3})
    view.add_record("QmP", "Pat", 64, 6.4, 1.0)
    with FileServer({"/swarm.json": view.to_json, "/bad.json": b'{"global_step": -1}', "/junk": b"<html>"}) as fs:
        summary = fetch_summary(fs.url + "swarm.json")
        assert (summary.global_step, summary.leaderboard[0].name) == (4, "Pat")
        with pytest.raises(SwarmUnavailable, match="global_step"):
            fetch_summary(fs.url + "bad.json")
        with pytest.raises(SwarmUnavailable, match="malformed"):
            fetch_summary(fs.url + "junk")
        with pytest.raises(SwarmUnavailable, match="Could not reach"):
            fetch_summary(fs.url + "missing")
    assert parse_summary(json.loads(view.to_json())).num_peers == 3


def test_the_public_summary_names_no_peer_and_a_member_token_is_sent():
    view = SwarmView("run")
    view.add_point({"time": 1.0, "step": 4, "loss": 1.5, "samples_per_second": 7.0, "num_peers": 2})
    view.add_record("QmPatPatPatPatPat11111111", "Pat", 64, 6.4, time.time())
    view.add_record("QmNoNameNoName22222222", "", 128, 12.8, time.time() - 500)
    public = view.to_json(public=True)
    assert b"Qm" not in public and b"22222222" not in public and b"11111111" not in public
    summary = parse_summary(public)
    assert summary.redacted and (summary.global_step, summary.num_peers) == (4, 2)
    assert [(c.name, c.samples, c.active, c.last_seen) for c in summary.leaderboard] == [
        (ANONYMOUS, 128, False, 0.0), ("Pat", 64, True, 0.0)]
    assert not parse_summary(view.to_json()).redacted

    with FileServer() as fs:
        fs.add_view("/swarm.json", lambda headers: view.to_json(public=bearer_token(headers) != "member"))
        assert fetch_summary(fs.url + "swarm.json").redacted
        full = fetch_summary(fs.url + "swarm.json", token="member")
        assert not full.redacted and full.leaderboard[1].peer_id == "QmPatPatPatPatPat11111111"
