"""Invites without a swarm: tokens, the organizer's store and CLI, the backbone's real HTTP endpoints
(redeem and renew with identity proofs) and the errors a volunteer reads."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from conftest import tiny_experiment
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from dedloc_core import invites
from dedloc_core.catalog import Experiment
from dedloc_core.errors import EXIT_EXPLAINED
from dedloc_core.invites import InviteError
from dedloc_core.organizer import invites as org
from dedloc_core.organizer.httpserve import FileServer

ROOT = Path(__file__).resolve().parents[1]


def identity():
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def peer_of(key) -> str:
    return invites.peer_id_of_der(invites.public_der(key))


def test_token_is_bound_to_run_peer_issuer_and_time():
    issuer, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    pub = invites.load_public_key(invites.public_key_text(issuer))
    now = time.time()
    token = invites.issue(issuer, invites.Claims("run", "peerA", now, now + 60, "inv-1"))
    assert invites.verify(token, pub, "run", "peerA").invite == "inv-1"
    assert not invites.is_valid(token, pub, "other-run", "peerA")
    assert not invites.is_valid(token, pub, "run", "peerB")
    assert not invites.is_valid(token, pub, "run", "peerA", now=now + 61)
    forged = invites.issue(other, invites.Claims("run", "peerA", now, now + 60, "inv-1"))
    assert not invites.is_valid(forged, pub, "run", "peerA")
    head, payload, sig = token.split(".")
    assert not invites.is_valid(".".join([head, payload[:-2] + "xx", sig]), pub, "run", "peerA")


def test_peer_id_matches_libp2p(tmp_path):
    from hivemind.p2p import P2P, PeerID

    path = tmp_path / "id.key"
    P2P.generate_identity(str(path))
    data = path.read_bytes()
    assert peer_of(invites.load_identity(data)) == PeerID.from_identity(data).to_base58()


def test_catalog_checks_invite_fields():
    key = invites.public_key_text(Ed25519PrivateKey.generate())
    ok = msgspec.convert(tiny_experiment(needs_token=True, invite_key=key, invite_url="https://x.org/"), Experiment)
    assert ok.invite_key == key
    for bad in ({"needs_token": False, "invite_key": key}, {"needs_token": True, "invite_key": "abc"},
                {"needs_token": True, "invite_url": "file:///etc/passwd"}):
        with pytest.raises(ValueError):
            msgspec.convert(tiny_experiment(**bad), Experiment)


@pytest.fixture
def backbone(tmp_path):
    """The backbone's invite endpoints on a real HTTP server (``Issuer.add_routes``, as the backbone serves them)."""
    org.generate_key(tmp_path, "pw")
    issuer = org.Issuer(org.InviteStore(tmp_path), org.load_key(tmp_path, "pw"), "gated-run", lifetime=5.0)
    server = FileServer()
    issuer.add_routes(server)
    with server:
        yield issuer, server.url


def test_redeem_renew_revoke_over_http(backbone):
    issuer, url = backbone
    store = issuer.store
    code, invite_id = store.create(uses=1)
    alice, bob = identity(), identity()
    pub = invites.load_public_key(issuer.public_key_text)
    with pytest.raises(InviteError) as unknown:
        invites.renew(url, alice, "gated-run")  # not a member yet
    assert unknown.value.code == "invite_unknown"
    token = invites.redeem(url, code.lower().replace("-", " "), alice, "gated-run")  # typed loosely
    claims = invites.verify(token, pub, "gated-run", peer_of(alice))
    assert claims.invite == invite_id and claims.remaining() == pytest.approx(5.0, abs=1.0)
    assert invites.redeem(url, code, alice, "gated-run")  # the same peer again: no new use
    with pytest.raises(InviteError) as used:
        invites.redeem(url, code, bob, "gated-run")
    assert used.value.code == "invite_used_up"
    assert invites.verify(invites.renew(url, alice, "gated-run"), pub, "gated-run", peer_of(alice))
    store.revoke(peer_of(alice))
    with pytest.raises(InviteError) as revoked:
        invites.renew(url, alice, "gated-run")
    assert revoked.value.code == "invite_revoked"
    with pytest.raises(InviteError) as again:
        invites.redeem(url, code, alice, "gated-run")
    assert again.value.code == "invite_revoked"


def test_a_proof_for_another_identity_is_refused(backbone):
    issuer, url = backbone
    code, _ = issuer.store.create()
    alice, mallory = identity(), identity()
    request = invites._signed("redeem", mallory, "gated-run", org.normalize(code))
    request["peer_id"] = peer_of(alice)  # claims alice's peer id with mallory's key
    request["code"] = code
    with pytest.raises(InviteError) as refused:
        invites._post(url, "redeem", request, 5.0)
    assert refused.value.code == "token_invalid"
    assert issuer.store.list()[0].used == 0


def test_expired_and_unknown_codes(backbone):
    issuer, url = backbone
    code, _ = issuer.store.create(expires_in=0.2)
    time.sleep(0.4)
    with pytest.raises(InviteError) as expired:
        invites.redeem(url, code, identity(), "gated-run")
    assert expired.value.code == "invite_expired"
    with pytest.raises(InviteError) as unknown:
        invites.redeem(url, "AAAA-BBBB-CCCC-DDDD", identity(), "gated-run")
    assert unknown.value.code == "invite_unknown"
    with pytest.raises(InviteError) as down:
        invites.redeem("http://127.0.0.1:9/", code, identity(), "gated-run", timeout=2)
    assert down.value.code == "invite_unreachable"


def dedloc(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "dedloc_core.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "DEDLOC_INVITE_PASSPHRASE": "pw", **(env or {})})


def test_cli_create_list_revoke_and_redeem_errors(backbone, tmp_path):
    from hivemind.p2p import P2P

    issuer, url = backbone
    run_dir = str(tmp_path)
    made = dedloc("invite", "create", "--run-dir", run_dir, "--uses", "1", "--expires", "7d", "--note", "alice")
    assert made.returncode == 0, made.stderr
    code = made.stdout.strip()
    assert len(org.normalize(code)) == 16 and "shown only now" in made.stderr
    listed = dedloc("invite", "list", "--run-dir", run_dir)
    assert "open" in listed.stdout and "0/1" in listed.stdout and "alice" in listed.stdout
    assert code not in (tmp_path / org.DB_NAME).read_bytes().decode(errors="replace")  # only its hash is kept

    ident = tmp_path / "id.key"
    P2P.generate_identity(str(ident))
    ok = dedloc("invite", "redeem", url, code, "--identity", str(ident))
    assert ok.returncode == 0 and "Invite accepted for run gated-run" in ok.stdout, ok.stderr
    other = tmp_path / "id2.key"
    P2P.generate_identity(str(other))
    used = dedloc("invite", "redeem", url, code, "--identity", str(other))
    assert used.returncode == EXIT_EXPLAINED and "Invite code already used" in used.stderr
    assert "[invite_used_up]" in used.stderr
    unknown = dedloc("invite", "redeem", url, "NOPE-NOPE-NOPE-NOPE", "--identity", str(other))
    assert unknown.returncode == EXIT_EXPLAINED and "[invite_unknown]" in unknown.stderr
    assert "What to do:" in unknown.stderr
    short = dedloc("invite", "create", "--run-dir", run_dir, "--expires", "1s")
    time.sleep(1.2)
    expired = dedloc("invite", "redeem", url, short.stdout.strip(), "--identity", str(other))
    assert expired.returncode == EXIT_EXPLAINED and "[invite_expired]" in expired.stderr

    revoked = dedloc("invite", "revoke", "--run-dir", run_dir, code)
    assert revoked.returncode == 0 and "1 peer(s)" in revoked.stdout
    again = dedloc("invite", "redeem", url, code, "--identity", str(ident))
    assert again.returncode == EXIT_EXPLAINED and "[invite_revoked]" in again.stderr
    assert "revoked" in dedloc("invite", "list", "--run-dir", run_dir).stdout
    nothing = dedloc("invite", "revoke", "--run-dir", run_dir, "no-such-thing")
    assert nothing.returncode == EXIT_EXPLAINED and "Nothing to revoke" in nothing.stderr
    bad = dedloc("invite", "create", "--run-dir", run_dir, "--expires", "soon")
    assert bad.returncode == EXIT_EXPLAINED and "Traceback" not in bad.stderr
