"""An invite-only experiment's backbone over real HTTP: strangers see the swarm's aggregates and
display names but no peer id (with the ids, an outside check found every member's address), and get
401 for the training data unless the catalog marks it public; a member's token (``Authorization:
Bearer``) gets the full summary and the data. An open experiment serves everything to everyone.

The backbone here is ``Backbone._serve_http`` with a real signed catalog, a real issuer key and a
real ``SwarmView``: no hivemind peer is started."""

from __future__ import annotations

import http.client
import json
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import CORPUS_MANIFEST, tiny_experiment
from netlab.peers import signed_catalog

from dedloc_core import invites as tokens
from dedloc_core.organizer import backbone as bb
from dedloc_core.organizer import invites as org
from dedloc_core.stats.swarmview import ANONYMOUS, SwarmView, parse_summary

ALICE = "QmAliceAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA1"
NONAME = "QmNoNameBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB12345678"
SHARD = CORPUS_MANIFEST["shards"][0]


def view(run_id: str) -> SwarmView:
    v = SwarmView(run_id)
    now = time.time()
    for step in range(1, 6):
        v.add_point({"time": now - 60 + step, "step": step, "loss": 3.0 - step / 10, "samples_per_second": 40.0,
                     "num_peers": 2})
    v.add_record(ALICE, "Alice", 5200, 3723.4, now - 3)
    v.add_record(NONAME, "", 3100, 1800.0, now - 1000)
    v.set_status(5, 80.5, 2)
    return v


@contextmanager
def backbone(tmp_path: Path, monkeypatch, **overrides):
    """``_serve_http`` of a backbone for a catalog holding one experiment: (base URL, Backbone)."""
    monkeypatch.setenv("DEDLOC_INVITE_PASSPHRASE", "pw")
    run_dir = tmp_path / "run"
    closed = overrides.pop("needs_token", True)
    gated = {}
    if closed:
        gated = dict(needs_token=True, invite_key=org.generate_key(run_dir, "pw"), invite_url="http://127.0.0.1:9/")
    exp = tiny_experiment(id="closed-test", run_id="closed_test", **gated, **overrides)
    catalog, key = signed_catalog(exp, tmp_path / "catalog")
    node = bb.Backbone(bb.parse_args(["--experiment", exp["id"], "--catalog", str(catalog), "--trusted-key", str(key),
                                      "--run-dir", str(run_dir)]))
    data, experiment, key_line = node._load_catalog()
    node.issuer = node._issuer(experiment) if experiment.needs_token else None
    node.view = view(experiment.run_id)
    with ExitStack() as stack:
        yield node._serve_http(stack, data, experiment, key_line), node


def get(base: str, path: str, token: str | None = None, method: str = "GET") -> tuple[int, dict, bytes]:
    address = urlsplit(base)
    conn = http.client.HTTPConnection(address.hostname or "", address.port, timeout=10)
    try:
        conn.request(method, path, headers={"Authorization": f"Bearer {token}"} if token else {})
        response = conn.getresponse()
        return response.status, dict(response.headers), response.read()
    finally:
        conn.close()


def strangers_tokens(node: bb.Backbone) -> dict[str, str]:
    """Tokens a stranger might send: forged, for another run, expired, garbage."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    now = time.time()
    return {
        "forged": tokens.issue(Ed25519PrivateKey.generate(), tokens.Claims("closed_test", ALICE, now, now + 600, "x")),
        "other run": tokens.issue(node.issuer.key, tokens.Claims("other_run", ALICE, now, now + 600, "x")),
        "expired": tokens.issue(node.issuer.key, tokens.Claims("closed_test", ALICE, now - 600, now - 1, "x")),
        "garbage": "dl1.not.atoken",
    }


def test_strangers_see_no_peer_id_members_see_everything(tmp_path, monkeypatch):
    with backbone(tmp_path, monkeypatch) as (url, node):
        member = node.issuer.token_for(ALICE, "inv1")
        for who, token in {"anonymous": None, **strangers_tokens(node)}.items():
            status, headers, body = get(url, "/swarm.json", token)
            assert status == 200 and headers["Content-Type"] == "application/json", who
            for peer_id in (ALICE, NONAME):
                assert peer_id not in body.decode() and peer_id[-8:] not in body.decode(), (who, peer_id)
            public = parse_summary(body)
            assert public.redacted, who
            assert (public.global_step, public.num_peers, public.samples_per_second) == (5, 2, 80.5)
            assert len(public.learning_curve) == 5
            assert [(c.name, c.samples, c.last_seen) for c in public.leaderboard] == [
                ("Alice", 5200, 0.0), (ANONYMOUS, 3100, 0.0)], who

        status, _, body = get(url, "/swarm.json", member)
        full = parse_summary(body)
        assert status == 200 and not full.redacted
        assert [c.peer_id for c in full.leaderboard] == [ALICE, NONAME]
        assert all(c.last_seen > 0 for c in full.leaderboard)

        # the dashboard itself, the catalog and its key stay public
        for path in ("/", "/catalog.json", "/catalog.pub", "/invite/info"):
            assert get(url, path)[0] == 200, path


def test_closed_data_needs_a_member_token(tmp_path, monkeypatch):
    path = f"/data/{SHARD['name']}"
    with backbone(tmp_path, monkeypatch) as (url, node):
        member = node.issuer.token_for(ALICE, "inv1")
        for who, token in {"anonymous": None, **strangers_tokens(node)}.items():
            for method in ("GET", "HEAD"):
                status, headers, body = get(url, path, token, method)
                assert status == 401, (who, method)
                assert headers["WWW-Authenticate"] == "Bearer"
                assert headers["Content-Type"].startswith("text/plain")
                if method == "GET":
                    assert b"members" in body and len(body) < 200, body
            assert get(url, "/data/no-such-shard", token)[0] == 401  # says nothing about what exists
        status, _, body = get(url, path, member)
        assert status == 200 and len(body) == SHARD["size"]
        assert get(url, "/data/no-such-shard", member)[0] == 404


def test_a_revoked_members_token_gets_the_public_view_and_no_data_at_once(tmp_path, monkeypatch):
    code, _ = org.InviteStore(tmp_path / "run").create(uses=1)
    with backbone(tmp_path, monkeypatch) as (url, node):
        invite_id = node.issuer.store.redeem(code, ALICE)
        token = node.issuer.token_for(ALICE, invite_id)  # valid for its whole lifetime
        shard = f"/data/{SHARD['name']}"
        assert not parse_summary(get(url, "/swarm.json", token)[2]).redacted
        assert get(url, shard, token)[0] == 200
        node.issuer.store.revoke(ALICE)
        assert parse_summary(get(url, "/swarm.json", token)[2]).redacted
        assert get(url, shard, token)[0] == 401


def test_closed_data_the_catalog_marks_public_is_served_to_anyone(tmp_path, monkeypatch):
    data = tiny_experiment()["data"]
    with backbone(tmp_path, monkeypatch, data={**data, "public": True}) as (url, _):
        status, _, body = get(url, f"/data/{SHARD['name']}")
        assert status == 200 and len(body) == SHARD["size"]
        assert parse_summary(get(url, "/swarm.json")[2]).redacted  # the member list stays hidden


def test_an_open_experiment_serves_everything_to_everyone(tmp_path, monkeypatch):
    with backbone(tmp_path, monkeypatch, needs_token=False) as (url, _):
        assert get(url, f"/data/{SHARD['name']}")[0] == 200
        summary = json.loads(get(url, "/swarm.json")[2])
        assert not summary["redacted"] and [c["peer_id"] for c in summary["leaderboard"]] == [ALICE, NONAME]


@pytest.mark.parametrize("public", [False, True])
def test_data_public_is_a_catalog_field(public):
    from dedloc_core.catalog.model import experiment_from

    data = tiny_experiment()["data"]
    exp = experiment_from(tiny_experiment(data={**data, "public": public} if public else data))
    assert exp.data.public is public


@pytest.mark.slow  # a headless browser
def test_the_dashboard_of_a_closed_experiment_shows_names_not_peer_ids(tmp_path, monkeypatch):
    from test_dashboard import chromium, rows

    with backbone(tmp_path, monkeypatch) as (url, _):
        dom = chromium(tmp_path, url, "--dump-dom")
    assert [r[1:3] for r in rows(dom)] == [["Alice", "5,200"], [ANONYMOUS, "3,100"]]
    assert ALICE not in dom and NONAME not in dom and NONAME[-8:] not in dom
    assert '<b id="peers">2</b>' in dom
