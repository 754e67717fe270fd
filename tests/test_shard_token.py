"""An invite-only experiment's shards over real HTTP: the shard cache sends the member's token as
``Authorization: Bearer`` (never on to a redirect's target), a refusal (401, 403) is one clear
``ShardError("refused")`` after a single request, not three retries; ``fetch_in_background`` obtains
the token on its thread before it downloads; ``invited.data_token`` says which data needs one."""

from __future__ import annotations

import hashlib
import http.server
import threading
from pathlib import Path

import msgspec
import pytest
from conftest import tiny_experiment

from dedloc_core.catalog.model import Experiment
from dedloc_core.catalog.shards import Shard
from dedloc_core.engine import invited
from dedloc_core.engine.shard_cache import ShardCache, fetch_in_background
from dedloc_core.errors import ShardError
from dedloc_core.invites import InviteError
from dedloc_core.organizer.httpserve import FileServer, bearer_token

BODY = b"the training data of members only\n" * 100
SHARD = Shard(url="data/a.txt", sha256=hashlib.sha256(BODY).hexdigest(), size=len(BODY))


@pytest.fixture()
def server(tmp_path: Path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_bytes(BODY)
    seen: list[str | None] = []

    def allow(headers) -> bool:
        seen.append(headers.get("Authorization"))
        return bearer_token(headers) == "good"

    with FileServer() as fs:
        fs.serve_dir("/data/", tmp_path / "data")
        fs.guard("/data/", allow, "this experiment's data is for its members")
        fs.seen = seen  # type: ignore[attr-defined]
        yield fs


def cache(tmp_path: Path, token: str | None) -> ShardCache:
    return ShardCache(tmp_path / "cache", max_bytes=1 << 20, retries=3, backoff=0.01, token=token)


def test_the_token_goes_with_each_request(server, tmp_path):
    path = cache(tmp_path, "good").fetch(SHARD, server.url)
    assert path.read_bytes() == BODY
    assert server.seen == ["Bearer good"]


@pytest.mark.parametrize("token", [None, "bad"])
def test_a_refusal_is_one_clear_error_not_retries(server, tmp_path, token):
    with pytest.raises(ShardError) as caught:
        cache(tmp_path, token).fetch(SHARD, server.url)
    err = caught.value
    assert err.code == "refused" and err.title == "Training data refused" and err.hint
    assert "401" in err.message and "for its members" in err.message
    assert ("refused this computer's access token" in err.message) == (token is not None)
    assert server.count("/data/a.txt") == 1  # asking again with the same token gets the same answer
    assert not list((tmp_path / "cache").glob("*.part"))


def test_the_token_is_not_sent_on_to_a_redirect(tmp_path):
    seen: list[str | None] = []

    def target(headers) -> bytes:
        seen.append(headers.get("Authorization"))
        return BODY

    with FileServer() as other:
        other.add_view("/data/a.txt", target)

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                seen.append(self.headers.get("Authorization"))
                self.send_response(302)
                self.send_header("Location", other.url + "data/a.txt")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        httpd = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        try:
            path = cache(tmp_path, "good").fetch(SHARD, f"http://127.0.0.1:{httpd.server_address[1]}/")
        finally:
            httpd.shutdown()
            httpd.server_close()
    assert path.read_bytes() == BODY
    assert seen == ["Bearer good", None]


def test_fetch_in_background_obtains_the_token_first(server, tmp_path, monkeypatch):
    monkeypatch.setenv("DEDLOC_HOME", str(tmp_path / "home"))
    asked: list[str] = []

    def token() -> str:
        asked.append("token")
        return "good"

    paths = fetch_in_background([SHARD], server.url, token).result(timeout=30)
    assert asked == ["token"] and paths[0].read_bytes() == BODY

    def refused() -> str:
        raise InviteError("invite_missing", "no invite code is stored")

    with pytest.raises(InviteError) as caught:
        fetch_in_background([SHARD], server.url, refused).result(timeout=30)
    assert caught.value.code == "invite_missing"


def test_which_data_needs_a_token(tmp_path):
    def exp(**overrides) -> Experiment:
        return msgspec.convert(tiny_experiment(**overrides), Experiment)

    gated = dict(needs_token=True, invite_key="A" * 43 + "=", invite_url="http://127.0.0.1:9/")
    data = tiny_experiment()["data"]
    assert invited.data_token(exp(), str(tmp_path / "id.key")) is None
    assert invited.data_token(exp(**gated, data={**data, "public": True}), str(tmp_path / "id.key")) is None
    assert callable(invited.data_token(exp(**gated), str(tmp_path / "id.key")))
