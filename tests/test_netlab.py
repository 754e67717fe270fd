"""Swarm tests across real network boundaries (tests/netlab): a backbone and a public volunteer on
a public segment, volunteers behind masquerading home routers. Real workers, real hivemind."""

from __future__ import annotations

import time

import pytest
from conftest import tiny_experiment
from netlab.peers import Backbone, Peer, wait_until

pytestmark = pytest.mark.slow

NATED = ("via relay", "outbound only")


def experiment() -> dict:
    return tiny_experiment(target_batch_size=128, averaging_timeout=15.0, matchmaking_time=2.0)


def swarm(netlab, tmp_path, homes: int):
    exp = experiment()
    bb_host, pub_host = netlab.public("bb"), netlab.public("pub")
    backbone = Backbone(netlab, bb_host, exp, tmp_path)
    ready = backbone.wait_ready()
    pub = Peer(netlab, pub_host, tmp_path / "pub").start(exp, ready, seed=1)
    nated = [Peer(netlab, netlab.home(f"h{i}"), tmp_path / f"h{i}").start(exp, ready, seed=2 + i)
             for i in range(1, homes + 1)]
    return backbone, pub, nated


def test_lab_nat_blocks_inbound(netlab):
    pub, home = netlab.public("pub"), netlab.home("h1")
    server = netlab.popen(home, ["python3", "-c", "import socket,time;s=socket.socket();"
                                 "s.bind(('0.0.0.0',7000));s.listen();time.sleep(60)"])
    time.sleep(0.5)
    assert not netlab.can_connect(pub, home.ip, 7000), "a public host reached into a home network"
    listener = netlab.popen(pub, ["python3", "-c", "import socket,time;s=socket.socket();"
                                  "s.bind(('0.0.0.0',7000));s.listen();time.sleep(60)"])
    time.sleep(0.5)
    assert netlab.can_connect(home, pub.ip, 7000), "a home host could not connect out"
    netlab.cut(home)
    assert not netlab.can_connect(home, pub.ip, 7000, timeout=1), "a cut link still carried traffic"
    netlab.restore(home)
    assert netlab.can_connect(home, pub.ip, 7000)
    assert server.poll() is None and listener.poll() is None
    assert netlab.counters(home)[0] > 0


def test_nated_volunteer_joins_through_backbone(netlab, tmp_path):
    _, pub, (home,) = swarm(netlab, tmp_path, homes=1)
    peers = [pub, home]
    wait_until(peers, lambda: all(p.progress for p in peers), 150, "a peer reported no progress")
    assert pub.reachability == "direct"
    assert home.reachability in NATED
    start = max(p.step for p in peers)
    wait_until(peers, lambda: min(p.step for p in peers) >= start + 3 and home.rounds >= 1 and pub.rounds >= 1,
               240, "the global step did not advance with the NATed volunteer averaging")
    assert max(p.progress[-1].num_peers for p in peers) >= 2
    assert home.progress[-1].reachability in NATED


def test_two_volunteers_behind_two_routers_contribute(netlab, tmp_path):
    _, pub, homes = swarm(netlab, tmp_path, homes=2)
    peers = [pub, *homes]
    wait_until(peers, lambda: all(p.progress for p in peers), 180, "a peer reported no progress")
    assert all(h.reachability in NATED for h in homes)
    start = max(p.step for p in peers)
    wait_until(peers, lambda: min(p.step for p in peers) >= start + 2 and all(h.rounds >= 1 for h in homes),
               300, "a NATed volunteer never joined an averaging round")


def test_cut_link_recovers(netlab, tmp_path):
    _, pub, (home,) = swarm(netlab, tmp_path, homes=1)
    peers = [pub, home]
    wait_until(peers, lambda: all(p.progress for p in peers), 150, "a peer reported no progress")
    start = max(p.step for p in peers)
    wait_until(peers, lambda: min(p.step for p in peers) >= start + 2 and home.rounds >= 1, 240,
               "the swarm did not train before the cut")
    netlab.cut(netlab.hosts["h1"])
    cut_at, step_at_cut = time.monotonic(), pub.step
    # the public volunteer keeps training: it never waits on the cut peer longer than the timeout
    wait_until(peers, lambda: pub.step >= step_at_cut + 2, 120, "the public volunteer stalled during the cut")
    time.sleep(max(0.0, 30 - (time.monotonic() - cut_at)))
    netlab.restore(netlab.hosts["h1"])
    rounds_before = home.rounds
    wait_until(peers, lambda: home.rounds > rounds_before and abs(home.step - pub.step) <= 1, 240,
               "the NATed volunteer did not recover after the link came back")


def test_volunteer_refuses_to_relay_backbone_relays(netlab):
    """A NATed peer asks a public volunteer, then the backbone, for a relay reservation: the
    volunteer's p2pd runs with -relayService=0 (hivemind_patches patch 3) and refuses."""
    import subprocess
    import sys
    from pathlib import Path

    script = str(Path(__file__).parent / "netlab" / "p2pnode.py")
    env_cwd = dict(cwd=str(Path(__file__).parents[1]), env={**__import__("os").environ,
                   "PYTHONPATH": str(Path(__file__).parents[1])})
    addrs = {}
    for name, relay in (("bb", "1"), ("vol", "0")):
        host = netlab.public(name)
        proc = netlab.popen(host, [sys.executable, script, "serve", host.ip, "4001", relay],
                            stdout=subprocess.PIPE, text=True, **env_cwd)
        addrs[name] = proc.stdout.readline().strip()
        assert "/p2p/" in addrs[name], f"{name} did not start"
    home = netlab.home("h1")

    def reserve(via: str) -> str:
        proc = netlab.popen(home, [sys.executable, script, "reserve", addrs[via], "20"],
                            stdout=subprocess.PIPE, text=True, **env_cwd)
        out, _ = proc.communicate(timeout=90)
        return out.strip().splitlines()[-1] if out.strip() else ""

    assert reserve("vol") == "none", "a volunteer relayed for a stranger"
    assert reserve("bb") == "circuit", "the backbone did not relay"
