"""Revocation in an invite-only swarm (issue 49): revoking a peer closes the code it used, with a
real SQLite store and the backbone's real HTTP endpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

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
    """The backbone's invite endpoints on a real HTTP server (as ``Backbone._serve_http`` adds them)."""
    org.generate_key(tmp_path, "pw")
    issuer = org.Issuer(org.InviteStore(tmp_path), org.load_key(tmp_path, "pw"), RUN, lifetime=60.0)
    server = FileServer()
    server.add("/invite/info", issuer.info)
    server.add_post("/invite/redeem", lambda body: issuer.handle("redeem", body))
    server.add_post("/invite/renew", lambda body: issuer.handle("renew", body))
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
