"""Fuzzing the shard verifier (issue 16): a real ``FileServer`` on 127.0.0.1 serves arbitrary bytes
for a shard whose sha256 or size do not match them; ``ShardCache.fetch`` always ends in
``ShardError("corrupt")`` and leaves nothing behind. Arbitrary shard descriptions give a validation
error, ``ShardError("bad_url")`` or an http(s) URL."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dedloc_core.catalog.shards import Shard, resolve_url
from dedloc_core.engine.shard_cache import ShardCache
from dedloc_core.errors import EXIT_EXPLAINED, ShardError, user_message
from dedloc_core.organizer.httpserve import FileServer

FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_HTTP = settings(FUZZ, max_examples=100)  # each example downloads over HTTP (and fsyncs): ~50 ms
HEX64 = st.text("0123456789abcdef", min_size=64, max_size=64)
# bodies over the server's chunk size, built from a short pattern: drawing 60 kB byte by byte
# exceeds hypothesis's entropy budget and failed its data_too_large health check now and then
LARGE = st.builds(lambda pattern, size: (pattern * (size // len(pattern) + 1))[:size],
                  st.binary(min_size=1, max_size=256), st.integers(60_000, 70_000))


@pytest.fixture(scope="module")
def server() -> Iterator[FileServer]:
    saved = {name: os.environ.pop(name) for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                                                     "all_proxy", "ALL_PROXY") if name in os.environ}
    try:
        with FileServer() as fs:
            yield fs
    finally:
        os.environ.update(saved)


@st.composite
def wrong_shards(draw) -> tuple[bytes, Shard, bytes | None, bytes | None]:
    """Bytes the server sends, the shard the catalog describes (its sha256 never theirs), and what
    the cache may hold already: a partial download and a damaged complete copy."""
    served = draw(st.binary(max_size=3000) | LARGE)
    how = draw(st.sampled_from(("same size", "other size", "any")))
    size = len(served) if how == "same size" and served else draw(st.integers(1, 80_000))
    sha = draw(HEX64.filter(lambda h: h != hashlib.sha256(served).hexdigest()))
    if how == "any":
        sha = hashlib.sha256(served + b"!").hexdigest()
    part = draw(st.none() | st.binary(max_size=size + 10) | st.just(served[: size // 2]))
    damaged = draw(st.none() | st.binary(max_size=100) | st.just(served))
    return served, Shard(url="shard.bin", sha256=sha, size=size), part, damaged


@FUZZ_HTTP
@given(wrong_shards(), st.booleans())
@example((b"", Shard(url="shard.bin", sha256="0" * 64, size=1), None, None), True)
@example((b"x" * 10, Shard(url="shard.bin", sha256="0" * 64, size=10), b"x" * 5, b"x" * 10), True)
@example((b"x" * 10, Shard(url="shard.bin", sha256="0" * 64, size=10), b"x" * 20, None), False)
def test_bytes_that_do_not_match_are_corrupt_and_leave_nothing(server, case, ranges):
    served, shard, part, damaged = case
    server.ranges = ranges
    server.add("/shard.bin", served)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "cache"
        root.mkdir()
        if part is not None:
            (root / f"{shard.sha256}.part").write_bytes(part)
        if damaged is not None:
            (root / shard.sha256).write_bytes(damaged)
        cache = ShardCache(root, max_bytes=1 << 20, retries=2, backoff=0.0, timeout=10)
        with pytest.raises(ShardError) as info:
            cache.fetch(shard, base_url=server.url)
        assert info.value.code == "corrupt", info.value.message
        assert user_message(info.value).exit_code == EXIT_EXPLAINED
        assert sorted(p.name for p in root.iterdir()) == [".lock"]  # no part, no copy, no marker
        assert cache.usage() == 0


# ---------------------------------------------------------------------------- shard descriptions
TEXT = st.text(st.characters(exclude_categories=()), max_size=30) | st.text(max_size=30)
SCHEMES = st.sampled_from(["http://", "https://", "HTTPS://", "ftp://", "file://", "javascript:", "data:", "//",
                           "", "http:", "http:/"])
HOSTS = st.sampled_from(["example.org", "127.0.0.1", "[::1]", "[x]", "[::1", "h:99999", "h:-1", "h:abc", "",
                         "user:pw@h", "h:8080", "h%00", "h\\x"]) | TEXT
PATHS = st.lists(st.sampled_from(["a", "..", ".", "%2e%2e", "%2E.", "..%2f", "%2f", "\\..", "x?q=..", "#..", "",
                                  "~", "é", " ", "\x00", "\x7f"]) | TEXT, max_size=5).map("/".join)
URLS = st.builds(lambda s, h, p: s + h + p, SCHEMES, HOSTS, PATHS) | PATHS | TEXT
JSON_ANY = st.none() | st.booleans() | st.integers() | st.floats() | TEXT | st.lists(st.integers(), max_size=2)


@FUZZ
@given(URLS | JSON_ANY, HEX64 | HEX64.map(lambda h: h + "\n") | HEX64.map(str.upper) | TEXT | JSON_ANY,
       st.integers(-5, 64 * 2**30 + 5) | JSON_ANY, st.none() | URLS)
@example("a", "ab" * 32 + "\n", 1, "http://h/")  # a sha256 with a trailing newline: was accepted
@example("a", "ab" * 32, 1, "http://[x]/")
@example("http://h:99999/a", "ab" * 32, 1, None)
def test_any_shard_description_is_refused_or_resolves_to_an_http_url(url, sha, size, base):
    try:
        shard = msgspec.convert({"url": url, "sha256": sha, "size": size}, Shard)
    except msgspec.ValidationError:
        return
    assert len(shard.sha256) == 64 and set(shard.sha256) <= set("0123456789abcdef"), repr(shard.sha256)
    assert 0 < shard.size <= 64 * 2**30
    try:
        resolved = resolve_url(shard, base)
    except ShardError as exc:
        assert exc.code == "bad_url" and exc.message
        return
    parts = urlsplit(resolved)
    assert parts.scheme.lower() in ("http", "https") and parts.hostname, resolved
    assert resolved.isascii() and not any(ord(c) <= 0x20 or ord(c) == 0x7F for c in resolved), resolved
    assert ".." not in parts.path.split("/"), resolved
