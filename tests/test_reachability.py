"""Pure parts of reachability and of patch 5 (the lab tests in test_netlab.py do the real thing)."""

from __future__ import annotations

from dedloc_core.engine import hivemind_patches, reachability

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


def test_extra_p2pd_flags_reach_the_command_line():
    from hivemind.p2p.p2p_daemon import P2P

    hivemind_patches.install()
    hivemind_patches.set_p2pd_options(relayDiscovery=False)
    try:
        args = P2P._make_process_args("p2pd", relay=True)
    finally:
        hivemind_patches.set_p2pd_options(relayDiscovery=None)
    assert args == ["p2pd", "-relay=1", "-relayService=0", "-relayDiscovery=0"]
    assert P2P._make_process_args("p2pd", relay=True) == ["p2pd", "-relay=1", "-relayService=0"]
    hivemind_patches.set_relay_service(True)  # the backbone: p2pd's relay service stays on
    try:
        assert P2P._make_process_args("p2pd", relay=True) == ["p2pd", "-relay=1"]
    finally:
        hivemind_patches.set_relay_service(False)
