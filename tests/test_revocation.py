"""Revocation in an invite-only swarm (issue 49): revoking a peer closes the code it used; the
backbone's signed revocation list makes every member refuse a revoked peer within a minute, whatever
its token's lifetime. The light tests use a real SQLite store and the backbone's real HTTP endpoints; the slow
ones real hivemind peers on loopback in subprocess probes (``tests/probes.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dedloc_core import invites
from dedloc_core.invites import InviteError
from dedloc_core.organizer import invites as org
from dedloc_core.organizer.httpserve import FileServer

ROOT = Path(__file__).resolve().parents[1]
RUN = "gated-run"


def identity():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def peer_of(key) -> str:
    return invites.peer_id_of_der(invites.public_der(key))


def dedloc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dedloc_core.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "DEDLOC_INVITE_PASSPHRASE": "pw"})


@pytest.fixture
def backbone(tmp_path):
    """The backbone's invite endpoints on a real HTTP server (``Issuer.add_routes``, as the backbone serves them)."""
    org.generate_key(tmp_path, "pw")
    issuer = org.Issuer(org.InviteStore(tmp_path), org.load_key(tmp_path, "pw"), RUN, lifetime=60.0)
    server = FileServer()
    issuer.add_routes(server)
    with server:
        yield issuer, server.url


# ----------------------------------------------------------------------- 1. the code it used
def test_revoking_a_peer_closes_the_code_it_used(backbone, tmp_path):
    issuer, url = backbone
    code, invite_id = issuer.store.create(uses=5, note="the lab")
    alice, carol, alice_again = identity(), identity(), identity()
    invites.redeem(url, code, alice, RUN)
    invites.redeem(url, code, carol, RUN)

    revoked = dedloc("invite", "revoke", "--run-dir", str(tmp_path), peer_of(alice))
    assert revoked.returncode == 0, revoked.stderr
    # the organizer is told which code went with it, and that its other member stays
    assert f"closed the code it used (invite {invite_id})" in revoked.stdout, revoked.stdout
    assert "1 other member(s) stay members" in revoked.stdout, revoked.stdout

    # the revoked volunteer under a new identity: the code no longer admits anyone new
    with pytest.raises(InviteError) as refused:
        invites.redeem(url, code, alice_again, RUN)
    assert refused.value.code == "invite_revoked"
    assert "closed it to new computers" in refused.value.message
    with pytest.raises(InviteError) as renewal:
        invites.renew(url, alice, RUN)
    assert renewal.value.code == "invite_revoked"
    # the code's other member stays a member: it renews (and redeems again, no new use)
    pub = invites.load_public_key(issuer.public_key_text)
    assert invites.verify(invites.renew(url, carol, RUN), pub, RUN, peer_of(carol)).invite == invite_id
    assert invites.redeem(url, code, carol, RUN)
    [invite] = issuer.store.list()
    assert invite.state() == "closed" and invite.used == 2 and not invite.revoked
    listed = json.loads(dedloc("invite", "list", "--run-dir", str(tmp_path), "--json").stdout)
    assert listed["invites"][0]["state"] == "closed"
    assert [p["revoked"] is not None for p in listed["peers"]] == [True, False]


def test_an_invites_db_from_before_gains_the_closed_column(tmp_path):
    import sqlite3

    db = sqlite3.connect(tmp_path / org.DB_NAME)
    db.executescript("CREATE TABLE invites (id TEXT PRIMARY KEY, code_hash TEXT UNIQUE NOT NULL, created REAL "
                     "NOT NULL, expires REAL, uses INTEGER NOT NULL, note TEXT NOT NULL DEFAULT '', revoked REAL);"
                     "INSERT INTO invites VALUES ('inv-old', 'h', 1.0, NULL, 3, '', NULL);")
    db.close()
    store = org.InviteStore(tmp_path)
    assert [i.state() for i in store.list()] == ["open"]


def test_revoked_peers_are_those_whose_tokens_may_still_be_valid(tmp_path):
    store = org.InviteStore(tmp_path)
    code, _ = store.create(uses=3)
    for peer in ("peerA", "peerB", "peerC"):
        store.redeem(code, peer)
    store.revoke("peerA")
    before = time.time()
    store.revoke("peerB")
    assert [p for p, _ in store.revoked_peers(0.0)] == ["peerA", "peerB"]
    assert [p for p, _ in store.revoked_peers(before)] == ["peerB"]


# ----------------------------------------------------------------------- 2. the signed list
def test_a_revocation_list_counts_only_signed_by_the_issuer_for_this_run():
    issuer, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    pub = invites.load_public_key(invites.public_key_text(issuer))
    text = invites.sign_revocations(issuer, RUN, ["peerB", "peerA", "peerA"], issued=100.0)
    assert invites.read_revocations(text, pub, RUN) == invites.Revocations(RUN, 100.0, frozenset({"peerA", "peerB"}))
    forged = invites.sign_revocations(other, RUN, [])
    head, payload, sig = text.split(".")
    emptied = invites._b64(json.dumps({"run": RUN, "iat": 100.0, "peers": []}).encode())
    for bad in (forged, invites.sign_revocations(issuer, "other-run", ["peerA"]), f"{head}.{emptied}.{sig}",
                "rl1.e30.", "dl1.x.y", "", "x" * 100):
        with pytest.raises(InviteError) as refused:
            invites.read_revocations(bad, pub, RUN)
        assert refused.value.code == "token_invalid"


def test_the_dht_authorizer_refuses_a_listed_peer_and_a_stolen_token_every_time():
    # in pytest's process: gate and hivemind's authorizer only, no extension installed, no peer started
    from hivemind.proto.auth_pb2 import AccessToken
    from hivemind.utils.crypto import RSAPrivateKey

    from dedloc_core.engine import gate

    issuer = Ed25519PrivateKey.generate()
    ours, alice, mallory = RSAPrivateKey(), RSAPrivateKey(), RSAPrivateKey()
    alice_id = invites.peer_id_of_der(gate._der(alice.get_public_key()))
    now = time.time()
    token = invites.issue(issuer, invites.Claims(RUN, alice_id, now, now + 1800, "inv-1"))
    gate.configure(RUN, invites.public_key_text(issuer))
    try:
        auth = gate.InviteAuthorizer(ours, gate.TokenHolder(""))
        alices = AccessToken(username=token, public_key=alice.get_public_key().to_bytes())
        stolen = AccessToken(username=token, public_key=mallory.get_public_key().to_bytes())
        assert [auth.is_token_valid(stolen) for _ in range(3)] == [False] * 3  # cached as bad, never as good
        assert [auth.is_token_valid(alices) for _ in range(2)] == [True] * 2
        listed = invites.sign_revocations(issuer, RUN, [alice_id])
        gate._revoked.put(invites.read_revocations(listed, gate._public_key, RUN))
        assert gate.is_revoked(alice_id) and not auth.is_token_valid(alices)  # with 30 min left on its token
        older = invites.sign_revocations(issuer, RUN, [], issued=now - 60)
        assert not gate._revoked.put(invites.read_revocations(older, gate._public_key, RUN))  # no going back
        assert not auth.is_token_valid(alices)
    finally:
        gate.disable()


# A backbone's keeper, as keeper.keep runs it for an invite-only swarm: the issuer (real invites.db in
# the run dir), its own token in the DHT, and the revocation list (keeper._RevocationList), checked
# every 0.5 s; argv: run dir, "list" or "no-list". Prints its addresses, runs until stdin closes.
KEEPER = """
import json, logging, sys, tempfile, threading, time
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
import hivemind
from hivemind.p2p import P2P, PeerID
from dedloc_core.engine import gate, hivemind_ext, metrics
from dedloc_core.engine.keeper import _RevocationList
from dedloc_core.organizer import invites as org
run_dir, publish_list = sys.argv[1], sys.argv[2] == "list"
hivemind_ext.install()
issuer = org.Issuer(org.InviteStore(run_dir), org.load_key(run_dir, "pw"), "gated-run", lifetime=1800.0)
gate.configure("gated-run", issuer.public_key_text)
path = tempfile.mkdtemp() + "/id.key"
P2P.generate_identity(path)
peer = PeerID.from_identity(open(path, "rb").read()).to_base58()
holder = gate.TokenHolder(issuer.token_for(peer, "backbone"))
dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=path,
                   authorizer=gate.InviteAuthorizer(metrics.load_identity_key(path), holder))
subkey = metrics.add_validators(dht, "gated-run", metrics.load_identity_key(path))
gate.publish(dht, holder.get(), subkey=subkey)
revocations = _RevocationList(issuer, dht, subkey)
print(json.dumps([str(a) for a in dht.get_visible_maddrs()]), flush=True)
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
while not done.wait(0.5):
    if publish_list:
        revocations.publish_if_due()
dht.shutdown()
"""

# Invited members A and B (argv: keeper's addresses, then identity path and token of each): our
# hivemind patches, the gate on, a DHT with the invite authorizer and a state-sharing averager each.
MEMBERS = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
logging.getLogger("dedloc_core.engine.gate").setLevel(logging.INFO)
import torch, hivemind
from dedloc_core import invites
from dedloc_core.engine import gate, hivemind_ext, metrics
initial, issuer_key = json.loads(sys.argv[1]), sys.argv[2]
hivemind_ext.install()
gate.configure("gated-run", issuer_key)
dhts, averagers = [], []
for path, token in zip(sys.argv[3::2], sys.argv[4::2]):
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=path, initial_peers=initial,
                       authorizer=gate.InviteAuthorizer(metrics.load_identity_key(path), gate.TokenHolder(token)))
    subkey = metrics.add_validators(dht, "gated-run", metrics.load_identity_key(path))
    gate.publish(dht, token, subkey=subkey)
    averagers.append(hivemind.averaging.DecentralizedAverager([torch.ones(100)], dht=dht, prefix="gated",
                                                             target_group_size=4, start=True))
    dhts.append(dht)
print("ready", flush=True)
sys.stdin.read()
for a in averagers:
    a.shutdown()
for d in dhts:
    d.shutdown()
"""

# A revoked member that ignores the refusal: a valid token (30 min left), hivemind without our
# patches; every second it asks each member's DHT (a ping, signed with its token) and averager (a
# state download) and prints which of them answered. argv: keeper's addresses, issuer key, its
# identity path and token, the members' peer ids.
REVOKED = """
import asyncio, functools, json, logging, sys, time
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
import hivemind
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.timed_storage import get_dht_time
from dedloc_core.engine import gate, metrics
initial, issuer_key, path, token, members = (json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4],
                                             sys.argv[5:])
gate.configure("gated-run", issuer_key)  # only to check the members' answers, as the DHT protocol requires
async def ping(peer, _dht, node):  # runs in the DHT process (forked below: defined before it)
    return await node.protocol.call_ping(PeerID.from_base58(peer)) is not None
dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=path, initial_peers=initial,
                   authorizer=gate.InviteAuthorizer(metrics.load_identity_key(path), gate.TokenHolder(token)))
subkey = metrics.add_validators(dht, "gated-run", metrics.load_identity_key(path))
dht.store("gated-run_invites", subkey=subkey, value=token, expiration_time=get_dht_time() + 1800)
loop = asyncio.new_event_loop()
p2p = loop.run_until_complete(dht.replicate_p2p())  # its streams live on this loop
async def messages(peer):
    stub = hivemind.averaging.DecentralizedAverager.get_stub(p2p, PeerID.from_base58(peer), namespace="gated")
    return [m async for m in await stub.rpc_download_state(averaging_pb2.DownloadRequest())]
async def download(peer):
    try:
        return len(await asyncio.wait_for(messages(peer), 10)) > 0
    except Exception:
        return False
while True:
    row = {"t": time.time()}
    for peer in members:
        row[peer] = {"dht": dht.run_coroutine(functools.partial(ping, peer)),
                     "averager": loop.run_until_complete(download(peer))}
    print(json.dumps(row), flush=True)
    time.sleep(1.0)
"""


def _identities(tmp_path: Path, names) -> dict[str, tuple[str, str]]:
    """name -> (identity path, peer id), as hivemind writes an identity."""
    from hivemind.p2p import P2P

    out = {}
    for name in names:
        path = tmp_path / f"{name}.key"
        P2P.generate_identity(str(path))
        out[name] = (str(path), peer_of(invites.load_identity(path.read_bytes())))
    return out


def _start(code: str, *args: str, stdin=subprocess.PIPE) -> subprocess.Popen:
    """A probe in a session of its own, so that its DHT process and p2pd go with it (``_stop``)."""
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _stderr_tail(proc: subprocess.Popen) -> str:
    _stop(proc)
    return proc.stderr.read()[-3000:]


def run_revocation(tmp_path: Path, publish_list: bool, watch_for: float) -> tuple[float | None, list[dict]]:
    """Three members with 30-minute tokens (A and B, and C, which ignores refusals), a keeper; C is
    revoked with ``dedloc invite revoke``: (seconds until every member's DHT and averager refused
    C, or None if some still answer after ``watch_for`` s; C's rows after the revocation)."""
    org.generate_key(tmp_path, "pw")
    issuer = org.Issuer(org.InviteStore(tmp_path), org.load_key(tmp_path, "pw"), RUN, lifetime=1800.0)
    code, invite_id = issuer.store.create(uses=3)
    ids = _identities(tmp_path, "ABC")
    tokens = {}
    for name, (_, peer) in ids.items():
        issuer.store.redeem(code, peer)
        tokens[name] = issuer.token_for(peer, invite_id)
    procs = []
    try:
        keeper = _start(KEEPER, str(tmp_path), "list" if publish_list else "no-list")
        procs.append(keeper)
        maddrs = keeper.stdout.readline()
        assert maddrs, _stderr_tail(keeper)
        members = _start(MEMBERS, maddrs, issuer.public_key_text, ids["A"][0], tokens["A"], ids["B"][0], tokens["B"])
        procs.append(members)
        assert members.stdout.readline().strip() == "ready", _stderr_tail(members)
        revoked = _start(REVOKED, maddrs, issuer.public_key_text, ids["C"][0], tokens["C"], ids["A"][1], ids["B"][1],
                         stdin=subprocess.DEVNULL)
        procs.append(revoked)
        deadline = time.time() + 60
        while True:  # C is a member in good standing first: both members' DHT and averager answer it
            line = revoked.stdout.readline()
            assert line and time.time() < deadline, _stderr_tail(revoked)
            row = json.loads(line)
            if all(row[ids[n][1]]["dht"] and row[ids[n][1]]["averager"] for n in "AB"):
                break
        out = dedloc("invite", "revoke", "--run-dir", str(tmp_path), ids["C"][1])
        assert out.returncode == 0, out.stderr
        revoked_at = time.time()
        rows = []
        while time.time() < revoked_at + watch_for:
            line = revoked.stdout.readline()
            assert line, _stderr_tail(revoked)
            row = json.loads(line)
            rows.append({n: row[ids[n][1]] for n in "AB"} | {"t": round(row["t"] - revoked_at, 1)})
            if not any(v for n in "AB" for v in row[ids[n][1]].values()):
                return row["t"] - revoked_at, rows
        return None, rows
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.close()  # the keeper and the members shut down on EOF
        for proc in procs:
            try:
                proc.wait(timeout=0 if proc.stdin is None else 20)  # the revoked member polls until stopped
            except subprocess.TimeoutExpired:
                pass
            _stop(proc)  # whatever is left of its session (the DHT process, p2pd)


@pytest.mark.slow
def test_a_revoked_member_is_refused_by_every_member_within_a_minute(tmp_path):
    elapsed, rows = run_revocation(tmp_path, publish_list=True, watch_for=75.0)
    print(f"revoked member refused by every member's DHT and averager {elapsed} s after `dedloc invite revoke` "
          f"(its token had 30 min left)")
    assert elapsed is not None and elapsed <= 60.0, rows[-5:]
    refused_from = next(i for i, r in enumerate(rows) if not any(v for n in "AB" for v in r[n].values()))
    assert all(not any(v for n in "AB" for v in r[n].values()) for r in rows[refused_from:])  # and from then on


@pytest.mark.slow
def test_without_the_revocation_list_a_revoked_member_is_admitted_for_its_token_lifetime(tmp_path):
    elapsed, rows = run_revocation(tmp_path, publish_list=False, watch_for=65.0)
    assert elapsed is None, rows[-5:]
    assert all(rows[-1][n]["dht"] and rows[-1][n]["averager"] for n in "AB"), rows[-5:]
