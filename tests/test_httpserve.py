"""FileServer: routes, directories, ranges, HEAD and path traversal, against a real socket."""

from __future__ import annotations

import http.client
import os
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from dedloc_core.organizer.httpserve import FileServer, bearer_token

DATA = bytes(range(256)) * 4  # 1024 bytes


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[FileServer]:
    (tmp_path / "secret").write_bytes(b"top secret")
    shards = tmp_path / "shards"
    (shards / "sub").mkdir(parents=True)
    (shards / "a.bin").write_bytes(b"shard a")
    (shards / "sub" / "b.json").write_bytes(b'{"b": 1}')
    (shards / ".hidden").write_bytes(b"top secret")
    os.symlink(tmp_path / "secret", shards / "link_out")
    os.symlink(shards / "a.bin", shards / "link_in")
    (tmp_path / "catalog.json").write_bytes(b'{"catalog": true}')

    def broken() -> bytes:
        raise RuntimeError("boom")

    routes = {
        "/data.bin": DATA,
        "/catalog": tmp_path / "catalog.json",
        "notes.txt": lambda: "héllo".encode(),
        "/missing.bin": tmp_path / "nope",
        "/broken": broken,
    }
    with FileServer(routes) as fs:
        fs.serve_dir("shards", shards)
        yield fs


def request(
    server: FileServer, path: str, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, http.client.HTTPMessage, bytes]:
    """A raw request: http.client sends the path exactly as given (no ``..`` normalization)."""
    address = urlsplit(server.url)
    conn = http.client.HTTPConnection(address.hostname or "", address.port, timeout=5)
    try:
        conn.request(method, path, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


def test_url_and_full_get(server: FileServer) -> None:
    assert server.url == f"http://127.0.0.1:{server.port}/"
    status, headers, body = request(server, "/data.bin")
    assert (status, body) == (200, DATA)
    assert headers["Content-Length"] == str(len(DATA))
    assert headers["Content-Type"] == "application/octet-stream"
    assert headers["Accept-Ranges"] == "bytes"


@pytest.mark.parametrize(
    ("path", "content_type", "body"),
    [
        ("/catalog", "application/json", b'{"catalog": true}'),
        ("/notes.txt", "text/plain; charset=utf-8", "héllo".encode()),
        ("/shards/a.bin", "application/octet-stream", b"shard a"),
        ("/shards/sub/b.json", "application/json", b'{"b": 1}'),
        ("/shards/link_in", "application/octet-stream", b"shard a"),
        ("/data.bin?cache=no", "application/octet-stream", DATA),
    ],
)
def test_sources_and_content_types(server: FileServer, path: str, content_type: str, body: bytes) -> None:
    status, headers, got = request(server, path)
    assert (status, got) == (200, body)
    assert headers["Content-Type"] == content_type


@pytest.mark.parametrize(
    ("header", "start", "end"),
    [
        ("bytes=0-9", 0, 9),
        ("bytes=1000-", 1000, 1023),
        ("bytes=-24", 1000, 1023),
        ("bytes=1020-5000", 1020, 1023),
    ],
)
def test_range(server: FileServer, header: str, start: int, end: int) -> None:
    status, headers, body = request(server, "/data.bin", headers={"Range": header})
    assert status == 206
    assert body == DATA[start : end + 1]
    assert headers["Content-Range"] == f"bytes {start}-{end}/{len(DATA)}"
    assert headers["Content-Length"] == str(end - start + 1)
    assert server.requests[-1] == ("GET", "/data.bin", header)


def test_range_on_a_file(server: FileServer) -> None:
    status, headers, body = request(server, "/shards/a.bin", headers={"Range": "bytes=2-"})
    assert (status, body, headers["Content-Range"]) == (206, b"ard a", "bytes 2-6/7")


@pytest.mark.parametrize("header", ["bytes=1024-", "bytes=5-2", "bytes=abc", "bytes=-0", "bytes=-"])
def test_unsatisfiable_range_is_416(server: FileServer, header: str) -> None:
    status, headers, _ = request(server, "/data.bin", headers={"Range": header})
    assert status == 416
    assert headers["Content-Range"] == f"bytes */{len(DATA)}"


@pytest.mark.parametrize("header", ["bytes=0-1,5-6", "items=0-5"])
def test_other_ranges_are_ignored(server: FileServer, header: str) -> None:
    status, _, body = request(server, "/data.bin", headers={"Range": header})
    assert (status, body) == (200, DATA)


def test_head(server: FileServer) -> None:
    status, headers, body = request(server, "/shards/a.bin", method="HEAD")
    assert (status, body, headers["Content-Length"]) == (200, b"", "7")
    status, headers, body = request(server, "/data.bin", method="HEAD", headers={"Range": "bytes=0-3"})
    assert (status, body, headers["Content-Range"]) == (206, b"", f"bytes 0-3/{len(DATA)}")
    assert request(server, "/nothing", method="HEAD")[0] == 404


@pytest.mark.parametrize(
    "path",
    [
        "/nothing",
        "/missing.bin",
        "/shards/",
        "/shards/sub",
        "/shards/nope.bin",
        "/shards/../secret",
        "/shards/%2e%2e/secret",
        "/shards/%2E%2E/secret",
        "/shards/..%2fsecret",
        "/shards/sub/../../secret",
        "/shards/sub/%2e%2e/%2e%2e/secret",
        "/%2e%2e/secret",
        "/shards/..\\secret",
        "/shards/%5c..%5csecret",
        "/shards/a.bin%00",
        "/shards//a.bin",
        "/shards/.hidden",
        "/shards/%2ehidden",
        "/shards/link_out",
        "/shards/%ff",
        "shards/a.bin",
    ],
)
def test_not_found_and_traversal(server: FileServer, path: str) -> None:
    status, _, body = request(server, path)
    assert status == 404
    assert b"secret" not in body


def test_callable_failure_is_500(server: FileServer) -> None:
    assert request(server, "/broken")[0] == 500


def test_requests_are_recorded(server: FileServer) -> None:
    request(server, "/data.bin")
    request(server, "/data.bin", headers={"Range": "bytes=5-"})
    request(server, "/data.bin", method="HEAD")
    assert server.count("/data.bin") == 3
    assert server.count("/data.bin", method="HEAD") == 1
    assert server.requests == [
        ("GET", "/data.bin", None),
        ("GET", "/data.bin", "bytes=5-"),
        ("HEAD", "/data.bin", None),
    ]


def test_add_after_start_and_callable_is_called_each_time(server: FileServer) -> None:
    calls: list[int] = []

    def make() -> bytes:
        calls.append(1)
        return str(len(calls)).encode()

    server.add("/counter", make)
    assert request(server, "/counter")[2] == b"1"
    assert request(server, "/counter")[2] == b"2"


def test_server_that_ignores_ranges() -> None:
    with FileServer({"/d": DATA}, ranges=False) as fs:
        status, headers, body = request(fs, "/d", headers={"Range": "bytes=5-"})
    assert (status, body) == (200, DATA)
    assert "Accept-Ranges" not in headers


def test_quiet_logging(server: FileServer, capfd: pytest.CaptureFixture[str]) -> None:
    request(server, "/data.bin")
    request(server, "/nothing")
    assert capfd.readouterr().err == ""


def test_stop_is_idempotent_and_closes_the_port() -> None:
    fs = FileServer({"/x": b"x"}).start()
    url = fs.url
    fs.stop()
    fs.stop()
    address = urlsplit(url)
    with pytest.raises(ConnectionRefusedError):
        conn = http.client.HTTPConnection(address.hostname or "", address.port, timeout=2)
        conn.request("GET", "/x")
    with pytest.raises(RuntimeError):
        _ = fs.url


def test_bad_route_paths_are_refused() -> None:
    with pytest.raises(ValueError):
        FileServer({"/a/../b": b""})


def test_guard_answers_401_unless_its_check_allows(server: FileServer) -> None:
    seen: list[str | None] = []

    def allow(headers) -> bool:
        seen.append(headers.get("Authorization"))
        if headers.get("Authorization") == "Bearer boom":
            raise RuntimeError("a broken check")
        return bearer_token(headers) == "ok"

    server.guard("/shards/", allow, "members only")
    server.guard("/data.bin", lambda headers: False)
    for path in ("/shards/a.bin", "/shards/sub/b.json", "/shards/none"):
        for auth in ({}, {"Authorization": "Bearer no"}, {"Authorization": "Basic ok"},
                     {"Authorization": "Bearer boom"}):
            status, headers, body = request(server, path, headers=auth)
            assert status == 401 and headers["WWW-Authenticate"] == "Bearer", (path, auth)
            assert body == b"401 Unauthorized: members only\n"
    assert request(server, "/shards/a.bin", "HEAD")[0] == 401
    assert request(server, "/shards/a.bin", headers={"Authorization": "Bearer ok"})[2] == b"shard a"
    assert request(server, "/shards/none", headers={"Authorization": "bearer  ok "})[0] == 404
    assert request(server, "/data.bin", headers={"Authorization": "Bearer ok"})[0] == 401  # a path, exactly
    assert request(server, "/catalog")[0] == 200  # unguarded routes are not affected
    assert "Bearer ok" in seen


def test_a_view_is_rendered_for_each_requests_headers(server: FileServer) -> None:
    server.add_view("/who.json", lambda headers: f'{{"token": "{bearer_token(headers)}"}}'.encode())
    status, headers, body = request(server, "/who.json", headers={"Authorization": "Bearer abc"})
    assert status == 200 and headers["Content-Type"] == "application/json" and body == b'{"token": "abc"}'
    assert request(server, "/who.json")[2] == b'{"token": "None"}'
    assert request(server, "/who.json", "HEAD")[1]["Content-Length"] == "17"
