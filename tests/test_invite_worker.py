"""Invited volunteers end to end: a real ``dedloc backbone`` issuing tokens (lifetime 6 s), real
workers that read their invite code from a real Secret Service (gnome-keyring in a private D-Bus
session, as in LAB.md), redeem it over the backbone's HTTP endpoint, fetch their shards from the
backbone (members only: with the token), train, renew their tokens during the test and keep
averaging across the renewals; a revoked one stops with invite_revoked, one without a code with
invite_missing. No member refuses another as they join, nor the backbone anyone before the revocation.
The app sends the stored token for the members' swarm summary."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from conftest import start_command, tiny_experiment
from desktop import dbus_session
from swarmpeer import SwarmPeer, start_backbone, wait_until

pytestmark = pytest.mark.skipif(not (shutil.which("dbus-daemon") and shutil.which("gnome-keyring-daemon")),
                                reason="needs dbus-daemon and gnome-keyring-daemon (LAB.md)")


@pytest.fixture
def secret_service(monkeypatch, tmp_path):
    """A private session bus with an unlocked gnome-keyring; the test and its workers use it."""
    import keyring
    from keyring.backends import SecretService

    with dbus_session() as address:
        # its own keyring directory: a login keyring left in ~ with another password stays locked
        data = tmp_path / "keyring-data"
        data.mkdir()
        env = {**os.environ, "DBUS_SESSION_BUS_ADDRESS": address, "XDG_RUNTIME_DIR": str(tmp_path),
               "XDG_DATA_HOME": str(data)}
        daemon = subprocess.Popen(["gnome-keyring-daemon", "--foreground", "--unlock", "--components=secrets"],
                                  stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        daemon.stdin.write(b"pw")
        daemon.stdin.close()
        monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", address)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
        previous = keyring.get_keyring()
        keyring.set_keyring(SecretService.Keyring())
        try:
            from dedloc_core import secrets

            deadline = time.monotonic() + 60  # the daemon takes the bus name in a moment (seconds on a busy CI)
            while True:
                try:
                    secrets.set_invite("probe", "x")  # a write: reading works before the collection is unlocked
                    secrets.delete_invite("probe")
                    break
                except secrets.SecretError as exc:
                    if time.monotonic() > deadline or daemon.poll() is not None:
                        raise AssertionError(f"gnome-keyring did not serve the session bus: {exc}") from exc
                    time.sleep(0.2)
            yield
        finally:
            keyring.set_keyring(previous)
            daemon.kill()
            daemon.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RENEWED = "Access token renewed"


@pytest.mark.slow
def test_invited_volunteers_redeem_train_and_renew(secret_service, tmp_path, monkeypatch, spawn_worker):
    from dedloc_core import secrets
    from dedloc_core.organizer import invites as org

    monkeypatch.setenv("DEDLOC_INVITE_PASSPHRASE", "pw")
    monkeypatch.setenv("DEDLOC_TEST_LOG_LEVEL", "INFO")
    key = org.generate_key(tmp_path / "backbone", "pw")
    port = free_port()
    gated = dict(id="gated-test", run_id="gated_test", needs_token=True, invite_key=key,
                 invite_url=f"http://127.0.0.1:{port}/", target_batch_size=64)
    exp = tiny_experiment(**gated)
    code, _ = org.InviteStore(tmp_path / "backbone").create(uses=2, note="two volunteers")
    secrets.set_invite(exp["id"], code)
    backbone, ready, _ = start_backbone(exp, tmp_path, http=True,
                                        extra=("--http-port", str(port), "--token-lifetime", "6"))
    try:
        data = SimpleNamespace(url=ready["http_url"])  # the backbone's /data/: for members only
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(ready["http_url"] + exp["data"]["shards"][0]["url"], timeout=10)
        assert refused.value.code == 401
        peers = []
        for i in range(2):
            worker = spawn_worker(f"v{i}")
            assert not (worker.home / "identity.key").exists()  # written by the data fetch (invited.data_token)
            assert worker.send(start_command(data, worker.home, initial_peers=ready["maddrs"], seed=i, **gated))
            peer = SwarmPeer(worker)
            peer.name = f"v{i}"
            peers.append(peer)

        def renewals(peer) -> int:
            return (peer.worker.home / "worker.log").read_text().count(RENEWED)

        wait_until(peers, lambda: all(p.rounds >= 1 for p in peers), 240, "the invited volunteers did not average")
        joining = [(p.worker.home / "worker.log").read_text() for p in peers]
        wait_until(peers, lambda: all(renewals(p) >= 2 for p in peers), 120, "the tokens were not renewed")
        after = [p.rounds for p in peers]
        wait_until(peers, lambda: all(p.rounds >= r + 2 for p, r in zip(peers, after, strict=True)), 120,
                   "the volunteers stopped averaging after their tokens were renewed")
        assert org.InviteStore(tmp_path / "backbone").list()[0].used == 2

        # revoke the second volunteer: its next renewal is refused and it stops, saying why
        victim = next(s.peer_id for s in peers[1].states if s.peer_id)
        before = (tmp_path / "backbone.log").read_text()
        org.InviteStore(tmp_path / "backbone").revoke(victim)
        # it says so when its training loop next looks: after the step it is blocked in, which can
        # last two averaging rounds' timeouts (15 s each here, so up to 30 s)
        for _ in range(900):
            peers[1].drain()
            if peers[1].errors:
                break
            time.sleep(0.1)
        assert [e.code for e in peers[1].errors] == ["invite_revoked"], peers[1].errors
        assert peers[1].errors[0].fatal and "revoked" in peers[1].errors[0].message
        kept = peers[0].rounds
        wait_until(peers[:1], lambda: peers[0].rounds >= kept + 1 or renewals(peers[0]) >= 6, 60,
                   "the remaining volunteer stopped")
        # no invited peer was refused across its renewals; after the revocation only the victim may be
        # (its last token can expire while it is still blocked in a step)
        assert "Refused peer" not in before
        for peer, log in zip(peers, joining, strict=True):  # nor did the members refuse each other as they joined
            assert "Refused peer" not in log, (peer.name, [line for line in log.splitlines() if "Refused" in line])
        refused = set(re.findall(r"Refused peer (\w+)", (tmp_path / "backbone.log").read_text()[len(before):]))
        assert refused <= {victim}, (refused, victim)
    finally:
        backbone.stop(timeout=30)


@pytest.mark.slow
def test_a_volunteer_without_a_code_is_told_so(secret_service, tmp_path, monkeypatch, spawn_worker, corpus_server):
    from dedloc_core.organizer import invites as org

    monkeypatch.setenv("DEDLOC_INVITE_PASSPHRASE", "pw")
    key = org.generate_key(tmp_path / "backbone", "pw")
    port = free_port()
    issuer = org.Issuer(org.InviteStore(tmp_path / "backbone"), org.load_key(tmp_path / "backbone", "pw"), "gated_test")
    from dedloc_core.organizer.httpserve import FileServer

    server = FileServer(port=port)
    server.add_post("/invite/renew", lambda body: issuer.handle("renew", body))
    with server:
        worker = spawn_worker("nocode")
        assert worker.send(start_command(corpus_server, worker.home, id="gated-nocode", run_id="gated_test",
                                         needs_token=True, invite_key=key, invite_url=server.url))
        peer = SwarmPeer(worker)
        for _ in range(600):
            peer.drain()
            if peer.errors:
                break
            time.sleep(0.1)
    assert [(e.code, e.fatal) for e in peer.errors] == [("invite_missing", True)]
    assert "invite code" in peer.errors[0].message and peer.errors[0].hint


def test_the_app_sends_the_stored_token_for_the_members_swarm_summary(secret_service, tmp_path, monkeypatch):
    """The app's swarm summary of an invite-only experiment comes with the token the worker keeps
    in the keyring: the members' view (peer ids, so "you" on the leaderboard); without a stored or
    valid token, the public one."""
    import msgspec
    from test_closed_backbone import ALICE, backbone

    from app.controller import Controller
    from dedloc_core import secrets
    from dedloc_core.catalog.model import Experiment
    from dedloc_core.stats.swarmview import fetch_summary

    with backbone(tmp_path, monkeypatch) as (url, node):
        closed = node._load_catalog()[1]
        open_one = msgspec.structs.replace(closed, needs_token=False, invite_key=None, invite_url=None)
        assert isinstance(closed, Experiment) and Controller._member_token(open_one) is None
        assert Controller._member_token(closed) is None  # nothing stored yet
        assert fetch_summary(url + "swarm.json", token=Controller._member_token(closed)).redacted
        secrets.set_token(closed.id, node.issuer.token_for(ALICE, "inv1"))
        try:
            full = fetch_summary(url + "swarm.json", token=Controller._member_token(closed))
            assert not full.redacted and full.leaderboard[0].peer_id == ALICE
        finally:
            secrets.delete_token(closed.id)


@pytest.mark.slow
def test_a_worker_across_a_boundary_redeems_the_code_the_app_sent(tmp_path, monkeypatch, corpus_server):
    """A worker started through a command of its own with no keyring at all (as in WSL, or on a rig
    over ssh) gets the invite code in its start command: it redeems it with its own identity and
    trains; the code is used once."""
    import sys

    from msgspec.structs import replace

    from dedloc_core.organizer import invites as org
    from dedloc_core.organizer.httpserve import FileServer
    from dedloc_core.workerproc import WorkerProcess

    monkeypatch.setenv("DEDLOC_INVITE_PASSPHRASE", "pw")
    key = org.generate_key(tmp_path / "backbone", "pw")
    store = org.InviteStore(tmp_path / "backbone")
    code, _ = store.create(uses=1, note="a rig")
    issuer = org.Issuer(store, org.load_key(tmp_path / "backbone", "pw"), "gated_test")
    server = FileServer()
    for action in ("redeem", "renew"):
        server.add_post(f"/invite/{action}", lambda body, action=action: issuer.handle(action, body))
    far = tmp_path / "far"
    command = ["env", "PYTHON_KEYRING_BACKEND=keyring.backends.fail.Keyring", f"DEDLOC_HOME={far}",
               sys.executable, "-m", "dedloc_core.engine.worker"]
    with server:
        worker = WorkerProcess(command=command, env={**os.environ, "DEDLOC_LOG_LEVEL": "INFO"},
                               stderr=open(tmp_path / "worker.log", "w"))
        try:
            worker.start()
            start = start_command(corpus_server, far, id="gated-far", run_id="gated_test", needs_token=True,
                                  invite_key=key, invite_url=server.url)
            assert worker.send(replace(start, identity_path=None, invite_code=code))
            told = worker.wait_for(lambda e: getattr(e, "state", None) == "training" or getattr(e, "fatal", False),
                                   120)
            assert told is not None and told.type == "state", (told, (tmp_path / "worker.log").read_text()[-2000:])
            assert store.list()[0].used == 1 and (far / "data" / "identity.key").exists()
            assert worker.stop(timeout=30).name == "OK"
        finally:
            worker.kill()
