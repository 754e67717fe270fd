"""Fuzzing the backbone's HTTP side (issue 16): the real ``Backbone._serve_http`` (its FileServer with
``/catalog.json``, ``/catalog.pub``, ``/swarm.json`` from a SwarmView, the dashboard and ``/data/``;
no training keeper) on 127.0.0.1, hit over raw sockets with arbitrary methods, paths, versions,
headers and Range headers. Every request gets a status line back; no handler thread fails; the
server answers a normal GET afterwards."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import threading
import traceback
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import tiny_experiment
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dedloc_core.catalog import key_id, public_key_line, sign_catalog, verify_catalog
from dedloc_core.organizer import backbone, httpserve
from dedloc_core.stats.swarmview import SwarmView

FUZZ = settings(max_examples=500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
STATUSES = {200, 206, 400, 404, 405, 414, 416, 431, 501, 505}
DATA = bytes(range(256)) * 8


class _Backbone:
    """What the fuzz tests talk to: the backbone's server, its URL, the catalog it serves."""

    def __init__(self, stack: ExitStack, tmp: Path, issuer=None):
        data_dir = tmp / "data"
        (data_dir / "sub").mkdir(parents=True)
        (data_dir / "a.txt").write_bytes(DATA)
        (data_dir / "sub" / "b.json").write_bytes(b'{"b": 1}')
        (data_dir / ".hidden").write_bytes(b"secret")
        (tmp / "secret").write_bytes(b"secret")
        os.symlink(tmp / "secret", data_dir / "link_out")
        os.mkfifo(data_dir / "fifo")  # opening it would block the handler
        (data_dir / "empty").write_bytes(b"")
        key = Ed25519PrivateKey.generate()
        now = datetime.now(UTC)
        catalog = {"schema_version": 1, "catalog_id": "fuzz", "issued_at": now.isoformat(),
                   "expires_at": (now + timedelta(days=1)).isoformat(), "experiments": [tiny_experiment()]}
        self.catalog = sign_catalog(json.dumps(catalog), key)
        exp = verify_catalog(self.catalog, {key_id(key.public_key()): key.public_key()}).experiments[0]
        args = backbone.parse_args(["--run-dir", str(tmp / "run"), "--data-dir", str(data_dir),
                                    "--http-port", "0", "--contact", "<b>mail</b>"])
        node = backbone.Backbone(args)
        node.issuer = issuer  # an invite-only experiment's /invite/* endpoints (test_fuzz_invites.py)
        node.view = SwarmView.load(node.run_dir, exp.run_id)
        node.view.add_point({"time": 1.0, "step": 1, "num_peers": 1, "samples_per_second": 2.0, "loss": 3.0})
        node.view.add_record("QmPeer", "<i>peer</i>", 10, 1.0, 1.0)
        self.servers: list[httpserve.FileServer] = []
        original = backbone.FileServer

        def recording(*args, **kwargs):
            server = original(*args, **kwargs, rate_burst=10**9)  # the fuzz tests POST far more than a worker
            self.servers.append(server)
            return server

        backbone.FileServer = recording  # type: ignore[assignment,misc]
        try:
            self.url = node._serve_http(stack, self.catalog, exp, public_key_line(key.public_key()))
        finally:
            backbone.FileServer = original  # type: ignore[misc]
        self.address = (urlsplit(self.url).hostname, urlsplit(self.url).port)
        self.errors: list[str] = []


@contextlib.contextmanager
def serving(tmp: Path, issuer=None) -> Iterator[_Backbone]:
    """The backbone's HTTP side; a failing handler (which the client would see as a closed
    connection) is recorded instead of printed."""
    original = httpserve._handle_error
    with ExitStack() as stack:
        served = _Backbone(stack, tmp, issuer)

        def handle_error(method: str, path: str) -> None:
            served.errors.append(traceback.format_exc())

        httpserve._handle_error = handle_error  # type: ignore[assignment]
        try:
            yield served
        finally:
            httpserve._handle_error = original


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Iterator[_Backbone]:
    with serving(tmp_path_factory.mktemp("backbone")) as served:
        yield served


def exchange(address: tuple, request: bytes, timeout: float = 10.0) -> bytes:
    """Send ``request`` raw, then read the answer until the server closes the connection."""
    with socket.create_connection(address, timeout=timeout) as sock:
        reader_out: list[bytes] = []

        def read() -> None:
            chunks = []
            try:
                while chunk := sock.recv(65536):
                    chunks.append(chunk)
            except OSError:  # a reset after the answer (the server closed with our bytes unread)
                pass
            reader_out.append(b"".join(chunks))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            sock.sendall(request)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server answered and closed before reading everything
            pass
        reader.join(timeout + 5)
        assert not reader.is_alive(), f"no answer within {timeout} s to {request[:200]!r}"
        return reader_out[0]


def check_answer(node: _Backbone, request: bytes, method: bytes) -> tuple[int, bytes]:
    node.errors.clear()  # (a failing handler records its error before the client sees the connection close)
    answer = exchange(node.address, request)
    assert not node.errors, node.errors[0]
    assert answer.startswith((b"HTTP/1.0 ", b"HTTP/1.1 ")), (request[:300], answer[:300])
    status = int(answer[9:12])
    assert status in STATUSES, (request[:300], answer[:300])
    head, _, body = answer.partition(b"\r\n\r\n")
    lengths = [line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")[1:]
               if line.lower().startswith(b"content-length:")]
    if lengths and method != b"HEAD":
        assert len(body) == int(lengths[0]), (request[:300], head)
    return status, body


def normal_get(node: _Backbone) -> None:
    conn = http.client.HTTPConnection(*node.address, timeout=10)
    try:
        conn.request("GET", "/catalog.json")
        response = conn.getresponse()
        assert response.status == 200 and response.read() == node.catalog
    finally:
        conn.close()
    assert all(server._thread is not None and server._thread.is_alive() for server in node.servers)


# ----------------------------------------------------------------------------------- strategies
NAMES = [b"catalog.json", b"catalog.pub", b"swarm.json", b"index.html", b"", b"data", b"a.txt", b"sub", b"b.json",
         b".hidden", b"link_out", b"fifo", b"empty", b"..", b".", b"%2e%2e", b"%2E%2e", b"%2e", b"%00", b"%ff",
         b"%2f", b"%5c", b"\\", b"%", b"%zz", b"%c3%a9", b"\xc3\xa9", b"\xff", b"~", b"*", b"a" * 300]
SEGMENTS = st.sampled_from(NAMES) | st.binary(max_size=12)
PATHS = (st.builds(lambda first, rest, tail: first + b"/".join(rest) + tail,
                   st.sampled_from([b"/", b"/data/", b"//", b"/data//", b"", b"http://h/", b"*"]),
                   st.lists(SEGMENTS, max_size=6), st.sampled_from([b"", b"?", b"?a=..&b=%00", b"#x", b"?%ff"]))
         | st.integers(1, 66_000).map(lambda n: b"/" + b"a" * n))
METHODS = (st.sampled_from([b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"TRACE",
                            b"CONNECT", b"get", b"G\x00T", b"GET\xff"])
           | st.binary(min_size=1, max_size=10).map(lambda b: b"X" + b.replace(b"\n", b"")))
VERSIONS = st.sampled_from([b" HTTP/1.1", b" HTTP/1.0", b" HTTP/1.1", b" HTTP/1.0", b"", b" HTTP/0.9", b" HTTP/2.0",
                            b" HTTP/1.1.1", b" HTTP/x", b" HTTP/1.10", b" FOO", b" HTTP/1.1 extra", b" http/1.1"])
DIGITS = (st.integers(0, 3000).map(lambda n: str(n).encode()) | st.just(b"")
          | st.integers(0, 2**70).map(lambda n: str(n).encode())
          | st.integers(4000, 6000).map(lambda n: b"9" * n) | st.sampled_from([b"-1", b"0x10", b"\xb2", b"1e3", b" 5"]))
RANGES = (st.builds(lambda unit, a, b, more: unit + a + b"-" + b + more,
                    st.sampled_from([b"bytes=", b"bytes =", b"Bytes=", b"items=", b""]), DIGITS, DIGITS,
                    st.sampled_from([b"", b",0-1", b"-", b"x"]))
          | st.binary(max_size=30))
HEADER_NAMES = st.sampled_from([b"Range", b"Host", b"Content-Length", b"Transfer-Encoding", b"Expect",
                                b"Connection", b"If-Range", b"Accept-Encoding"]) | st.binary(min_size=1, max_size=10)
HEADER_VALUES = RANGES | st.binary(max_size=40) | st.sampled_from([b"100-continue", b"chunked", b"-1", b"keep-alive"])
HEADERS = st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES).map(lambda h: h[0] + b": " + h[1]), max_size=6)


@st.composite
def requests(draw) -> tuple[bytes, bytes]:
    method = draw(METHODS)
    lines = draw(HEADERS)
    if draw(st.booleans()):
        lines.append(b"Range: " + draw(RANGES))
    if draw(st.integers(0, 19)) == 0:  # now and then, more header lines than the server takes
        lines += [b"X-Many: 1"] * draw(st.integers(90, 120))
    body = draw(st.sampled_from([b"", b"hello", b"\x00" * 100]))
    head = method + b" " + draw(PATHS) + draw(VERSIONS) + b"\r\n"
    return method, head + b"".join(line.replace(b"\n", b" ") + b"\r\n" for line in lines) + b"\r\n" + body


@FUZZ
@given(requests())
@example((b"GET", b"GET /catalog.json HTTP/1.1\r\nRange: bytes=0-" + b"9" * 5000 + b"\r\n\r\n"))  # was a dead thread
@example((b"GET", b"GET /data/a.txt HTTP/1.1\r\nRange: bytes=-" + b"9" * 5000 + b"\r\n\r\n"))  # was a dead thread
@example((b"\x00\x01", b"\x00\x01\x02\r\n\r\n"))  # was a bare HTML body without a status line
@example((b"GET", b"GET /data/fifo HTTP/1.0\r\n\r\n"))
@example((b"GET", b"GET /data/%2e%2e/secret HTTP/1.0\r\n\r\n"))
@example((b"GET", b"GET /" + b"a" * 70_000 + b" HTTP/1.0\r\n\r\n"))
@example((b"GET", b"GET / HTTP/1.0\r\nX: " + b"a" * 70_000 + b"\r\n\r\n"))
@example((b"GET", b"GET /a HTTP/0.9\r\n\r\n"))  # was a bare body: HTTP/0.9 has no status line
@example((b"HEAD", b"HEAD / HTTP/0.9\r\n" + b"X: 1\r\n" * 101 + b"\r\n"))  # was nothing at all
@example((b"GET", b"GET /\t/catalog.json HTTP/0.9\r\n\r\n"))  # was a bare HTML page
def test_every_request_gets_a_status_line_and_the_server_stays_up(node, case):
    method, request = case
    status, body = check_answer(node, request, method.upper())
    assert status != 200 or b"secret" not in body  # nothing from outside /data/, nothing hidden
    normal_get(node)


@pytest.mark.parametrize("path, ranges", [
    ("/catalog.json", ["bytes=0-0", "bytes=-1", "bytes=5-", "bytes=0-99999999999999999999999"]),
    ("/data/a.txt", ["bytes=2047-", "bytes=2048-", "bytes=-0", "bytes=1-0", "bytes=0-1,2-3", "items=0-1"]),
    ("/data/empty", ["bytes=0-", "bytes=-5"]),
])
def test_range_answers_are_consistent(node, path, ranges):
    node.errors.clear()
    for header in ranges:
        conn = http.client.HTTPConnection(*node.address, timeout=10)
        try:
            conn.request("GET", path, headers={"Range": header})
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
        assert response.status in (200, 206, 416), (header, response.status)
        if response.status == 206:
            first, last = map(int, response.headers["Content-Range"].split()[1].split("/")[0].split("-"))
            assert len(body) == last - first + 1
    normal_get(node)
    assert not node.errors


def test_the_request_log_stays_bounded(node, monkeypatch):
    """``FileServer.requests`` (a test hook) keeps only the latest requests: a backbone serves for weeks."""
    monkeypatch.setattr(httpserve, "_MAX_RECORDED", 40)
    for _ in range(100):
        check_answer(node, b"GET /swarm.json HTTP/1.0\r\n\r\n", b"GET")
    assert all(len(server.requests) <= 40 for server in node.servers)
    assert node.servers[0].requests[-1] == ("GET", "/swarm.json", None)
