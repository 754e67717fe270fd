"""The backbone's dial-back service with real hivemind DHTs: it dials only addresses on the IP the
caller's own connection comes from (it is no port scanner for strangers), and in an invite-only
experiment only for a caller that names a valid token for its own peer id.

A probe process runs a backbone DHT listening on every interface, a TCP "target" listener on this
host's non-loopback address, and callers that connect over loopback or over that address."""

from __future__ import annotations

import psutil
import pytest

from tests import probes

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast

PROBE = """
import json, socket, sys, tempfile, threading, time
import hivemind
from hivemind.p2p import P2P, PeerID
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from dedloc_core import invites
from dedloc_core.engine import gate, reachability

host_ip, closed = sys.argv[1], sys.argv[2] == "closed"
RUN = "dialback-run"
issuer = Ed25519PrivateKey.generate()
if closed:
    gate.configure(RUN, invites.public_key_text(issuer))  # before the backbone's DHT forks

accepted = []
target = socket.create_server((host_ip, 0))
target_port = target.getsockname()[1]
def accept():
    while True:
        conn, peer = target.accept()
        accepted.append(peer)
        conn.close()
threading.Thread(target=accept, daemon=True).start()

backbone = hivemind.DHT(start=True, host_maddrs=["/ip4/0.0.0.0/tcp/0"])
reachability.serve_dialback(backbone)
maddrs = [str(m) for m in backbone.get_visible_maddrs()]
via_loopback = [m for m in maddrs if "/ip4/127.0.0.1/" in m]
via_host = [m for m in maddrs if f"/ip4/{host_ip}/" in m]
home = tempfile.mkdtemp()

def caller(listen_ip, initial):
    path = f"{home}/{listen_ip}-{len(accepted)}-{time.monotonic_ns()}.key"
    P2P.generate_identity(path)
    dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{listen_ip}/tcp/0"], initial_peers=initial,
                       identity_path=path)
    return dht, PeerID.from_identity(open(path, "rb").read()).to_base58()

def token(peer):
    now = time.time()
    return invites.issue(issuer, invites.Claims(RUN, peer, now, now + 300, "inv-test"))

def ask(dht, targets, tok=None):
    before = len(accepted)
    call = reachability._CallDialback(str(backbone.peer_id), targets, 10.0, tok)
    reached = dht.run_coroutine(call)
    time.sleep(0.3)
    return {"reached": reached, "connections": len(accepted) - before}

result = {}
stranger, stranger_id = caller("127.0.0.1", via_loopback)   # its connection comes from 127.0.0.1
target_maddr = f"/ip4/{host_ip}/tcp/{target_port}"
result["stranger_names_another_ip"] = ask(stranger, [target_maddr, "/ip4/10.255.255.1/tcp/22"],
                                          token(stranger_id) if closed else None)
volunteer, volunteer_id = caller(host_ip, via_host)         # its connection comes from host_ip
own = [str(m) for m in volunteer.get_visible_maddrs()]
result["own_address"] = ask(volunteer, own + [target_maddr], token(volunteer_id) if closed else None)
if closed:
    result["own_address_without_token"] = ask(volunteer, own)
    result["own_address_with_anothers_token"] = ask(volunteer, own, token(stranger_id))
    result["own_address_with_a_list_request"] = ask(volunteer, own, None)
print(json.dumps(result), flush=True)
for d in (stranger, volunteer, backbone):
    d.shutdown()
"""


def _host_ip() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family.name == "AF_INET" and not a.address.startswith("127."):
                return a.address
    return None


@pytest.fixture(scope="module")
def host_ip() -> str:
    ip = _host_ip()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address for a caller to come from")
    return ip


def test_dialback_dials_only_the_callers_own_ip(host_ip):
    result = probes.probe_json(PROBE, host_ip, "open")
    stranger = result["stranger_names_another_ip"]
    # over loopback the caller's IP is 127.0.0.1: the target on host_ip and the private address are not its own
    assert stranger == {"reached": [], "connections": 0}
    own = result["own_address"]
    assert own["reached"], own  # its own listen address (and the target, on the same host IP) is dialled
    assert all(f"/ip4/{host_ip}/" in m for m in own["reached"])


def test_closed_experiment_dials_back_only_for_the_callers_own_valid_token(host_ip):
    result = probes.probe_json(PROBE, host_ip, "closed")
    assert result["stranger_names_another_ip"] == {"reached": [], "connections": 0}
    assert result["own_address"]["reached"], result  # a member with its own token
    for case in ("own_address_without_token", "own_address_with_anothers_token", "own_address_with_a_list_request"):
        assert result[case] == {"reached": [], "connections": 0}, case
