"""Pure parts of reachability and of ``hivemind_ext.relay_policy`` (the lab tests in test_netlab.py do
the real thing)."""

from __future__ import annotations

from probes import probe_json

from dedloc_core.engine import reachability

PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def test_dialback_dials_only_plain_tcp_addresses_that_are_not_loopback():
    assert reachability._tcp_endpoint(f"/ip4/192.0.0.130/tcp/4001/p2p/{PEER}") == ("192.0.0.130", 4001)
    assert reachability._tcp_endpoint(f"/ip4/127.0.0.1/tcp/4001/p2p/{PEER}") is None
    assert reachability._tcp_endpoint("/ip4/0.0.0.0/tcp/4001") is None
    assert reachability._tcp_endpoint("/ip4/192.0.0.130/udp/4001/quic-v1") is None
    assert reachability._tcp_endpoint(f"/ip4/192.0.0.130/tcp/1/p2p/{PEER}/p2p-circuit/p2p/{PEER}") is None
    assert reachability._tcp_endpoint("not a multiaddr") is None


def test_only_loopback():
    assert reachability.only_loopback(["/ip4/127.0.0.1/tcp/0"])
    assert not reachability.only_loopback(["/ip4/127.0.0.1/tcp/0", "/ip4/0.0.0.0/tcp/0"])


# p2pd's command line as P2P.create builds it, in a fresh interpreter (the extensions are never
# installed in pytest's): a volunteer with an extra flag, a plain volunteer, the backbone. Args: the
# extensions left out.
FLAGS = """
import json, sys
from hivemind.p2p.p2p_daemon import P2P
from dedloc_core.engine import hivemind_ext
hivemind_ext.install(skip=sys.argv[1:])
hivemind_ext.set_p2pd_options(relayDiscovery=False)
extra = P2P._make_process_args("p2pd", relay=True)
hivemind_ext.set_p2pd_options(relayDiscovery=None)
volunteer = P2P._make_process_args("p2pd", relay=True)
hivemind_ext.set_relay_service(True)  # the backbone: p2pd's relay service stays on
backbone = P2P._make_process_args("p2pd", relay=True)
print(json.dumps(dict(extra=extra, volunteer=volunteer, backbone=backbone)))
"""


def test_extra_p2pd_flags_reach_the_command_line():
    got = probe_json(FLAGS)
    assert got["extra"] == ["p2pd", "-relay=1", "-relayService=0", "-relayDiscovery=0"]
    assert got["volunteer"] == ["p2pd", "-relay=1", "-relayService=0"]
    assert got["backbone"] == ["p2pd", "-relay=1"]


def test_without_the_relay_policy_a_volunteers_p2pd_offers_a_relay_service():
    got = probe_json(FLAGS, "relay_policy")
    assert got["volunteer"] == ["p2pd", "-relay=1"], got  # p2pd then relays for anyone who asks


class UnreachableDHT:
    """A test double for a started DHT that the dial-back cannot reach and, started with
    ``use_relay``, gets a relay address (a real one needs the network lab: test_netlab.py)."""

    def __init__(self, **extra):
        self.relayed, self.down = bool(extra.get("use_relay")), False

    def get_visible_maddrs(self, latest=False):
        circuit = f"/ip4/192.0.0.129/tcp/31337/p2p/{PEER}/p2p-circuit" if self.relayed else "/ip4/10.1.0.2/tcp/4001"
        return [circuit]

    def run_coroutine(self, _coroutine):
        return []  # the helper reached none of our addresses

    def shutdown(self):
        self.down = True


def test_each_dht_is_announced_before_its_dialback_and_the_last_one_stays():
    from dedloc_core.engine.swarm import SwarmConfig

    cfg = SwarmConfig(run_id="r", target_batch_size=8, batch_size_per_step=1,
                      initial_peers=[f"/ip4/192.0.0.129/tcp/31337/p2p/{PEER}"], host_maddrs=["/ip4/0.0.0.0/tcp/0"])
    announced: list[tuple[UnreachableDHT, bool]] = []
    dht, how = reachability.join(cfg, lambda _cfg, **extra: UnreachableDHT(**extra), relay_wait=1.0,
                                 on_start=lambda d: announced.append((d, d.down)))
    assert how == reachability.VIA_RELAY
    assert [down for _, down in announced] == [False, False]  # each announced while it was up
    (first, _), (last, _) = announced
    assert first.down and not first.relayed, "the unreachable DHT was not shut down"
    assert last is dht and last.relayed and not dht.down
