"""ShardCache against a real FileServer on 127.0.0.1: download, verify, resume, evict, fail clearly."""

from __future__ import annotations

import hashlib
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dedloc_core.engine.shard_cache import Shard, ShardCache, resolve_url
from dedloc_core.errors import ShardError
from dedloc_core.organizer.httpserve import FileServer

SIZE = 200_000


def blob(seed: int, size: int = SIZE) -> bytes:
    return random.Random(seed).randbytes(size)


def shard_for(data: bytes, url: str) -> Shard:
    return Shard(url=url, sha256=hashlib.sha256(data).hexdigest(), size=len(data))


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]


def cache_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != ".lock")


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture()
def server() -> Iterator[FileServer]:
    with FileServer() as fs:
        yield fs


@pytest.fixture()
def make_cache(tmp_path: Path) -> Callable[..., ShardCache]:
    def make(max_bytes: int = 10 * SIZE, **kwargs: float) -> ShardCache:
        kwargs.setdefault("backoff", 0.01)
        kwargs.setdefault("timeout", 5)
        return ShardCache(tmp_path / "cache", max_bytes, **kwargs)  # type: ignore[arg-type]

    return make


def test_download_verify_then_hit(server: FileServer, make_cache: Callable[..., ShardCache]) -> None:
    data = blob(1)
    server.add("/s/a.bin", data)
    shard = shard_for(data, server.url + "s/a.bin")
    cache = make_cache()
    seen: list[tuple[int, int]] = []

    path = cache.fetch(shard, progress=lambda done, total: seen.append((done, total)))
    assert path == cache.root / shard.sha256
    assert path.read_bytes() == data
    assert seen[-1] == (SIZE, SIZE) and seen[0][0] < SIZE
    assert cache_files(cache.root) == [shard.sha256, shard.sha256 + ".ok"]

    assert cache.fetch(shard) == path
    assert server.count("/s/a.bin") == 1  # the second fetch is a hit
    assert cache.usage() == SIZE


def test_relative_url_is_joined_to_base(server: FileServer, make_cache: Callable[..., ShardCache]) -> None:
    data = blob(2, 1000)
    server.add("/data/v1/part-0.bin", data)
    shard = shard_for(data, "part-0.bin")
    path = make_cache().fetch(shard, base_url=server.url + "data/v1")  # no trailing slash: still a folder
    assert path.read_bytes() == data
    assert server.requests == [("GET", "/data/v1/part-0.bin", None)]


def test_corrupted_cached_shard_is_fetched_again(
    server: FileServer, make_cache: Callable[..., ShardCache]
) -> None:
    data = blob(3)
    server.add("/a.bin", data)
    shard = shard_for(data, server.url + "a.bin")
    cache = make_cache()
    path = cache.fetch(shard)
    with open(path, "r+b") as handle:  # flip one byte, same size
        handle.seek(1234)
        handle.write(bytes([data[1234] ^ 0x01]))

    assert cache.fetch(shard).read_bytes() == data
    assert server.count("/a.bin") == 2


def test_corruption_is_found_even_with_mtime_restored(
    server: FileServer, make_cache: Callable[..., ShardCache]
) -> None:
    data = blob(4)
    server.add("/a.bin", data)
    shard = shard_for(data, server.url + "a.bin")
    cache = make_cache()
    path = cache.fetch(shard)
    before = path.stat()
    time.sleep(0.05)  # past the file system's coarse clock tick, so ctime moves
    path.write_bytes(flip(data, 99))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert cache.fetch(shard).read_bytes() == data
    assert server.count("/a.bin") == 2


def test_server_with_wrong_bytes_gives_corrupt(
    server: FileServer, make_cache: Callable[..., ShardCache]
) -> None:
    data = blob(5)
    server.add("/bad.bin", lambda: flip(data, 7))
    shard = shard_for(data, server.url + "bad.bin")
    cache = make_cache(retries=3)
    with pytest.raises(ShardError) as info:
        cache.fetch(shard)
    assert info.value.code == "corrupt"
    assert shard.url in info.value.message
    assert "sha256" in info.value.message
    assert server.count("/bad.bin") == 3
    assert cache_files(cache.root) == []


def test_server_sending_too_much_gives_corrupt(
    server: FileServer, make_cache: Callable[..., ShardCache]
) -> None:
    data = blob(6, 1000)
    server.add("/long.bin", data + b"extra")
    cache = make_cache(retries=2)
    with pytest.raises(ShardError) as info:
        cache.fetch(shard_for(data, server.url + "long.bin"))
    assert info.value.code == "corrupt"
    assert cache_files(cache.root) == []


def test_one_bad_download_is_retried_from_scratch(
    server: FileServer, make_cache: Callable[..., ShardCache]
) -> None:
    data = blob(7)
    answers = [flip(data, SIZE - 1), data]
    server.add("/flaky.bin", lambda: answers.pop(0))
    path = make_cache().fetch(shard_for(data, server.url + "flaky.bin"))
    assert path.read_bytes() == data
    assert server.count("/flaky.bin") == 2


def test_partial_download_is_resumed_with_range(
    server: FileServer, make_cache: Callable[..., ShardCache]
) -> None:
    data = blob(8)
    server.add("/a.bin", data)
    shard = shard_for(data, server.url + "a.bin")
    cache = make_cache()
    (cache.root / (shard.sha256 + ".part")).write_bytes(data[:75_000])
    seen: list[int] = []

    path = cache.fetch(shard, progress=lambda done, total: seen.append(done))
    assert path.read_bytes() == data
    assert server.requests == [("GET", "/a.bin", "bytes=75000-")]
    assert seen[0] == 75_000
    assert cache_files(cache.root) == [shard.sha256, shard.sha256 + ".ok"]


def test_bad_partial_download_is_discarded(server: FileServer, make_cache: Callable[..., ShardCache]) -> None:
    data = blob(9)
    server.add("/a.bin", data)
    shard = shard_for(data, server.url + "a.bin")
    cache = make_cache()
    (cache.root / (shard.sha256 + ".part")).write_bytes(flip(data, 10)[:50_000])

    assert cache.fetch(shard).read_bytes() == data
    assert [r[2] for r in server.requests] == ["bytes=50000-", None]


def test_server_ignoring_range_still_gives_the_right_file(make_cache: Callable[..., ShardCache]) -> None:
    data = blob(10)
    with FileServer({"/a.bin": data}, ranges=False) as fs:
        shard = shard_for(data, fs.url + "a.bin")
        cache = make_cache()
        (cache.root / (shard.sha256 + ".part")).write_bytes(b"x" * 60_000)  # wrong, and ignored
        assert cache.fetch(shard).read_bytes() == data
        assert fs.requests == [("GET", "/a.bin", "bytes=60000-")]


def test_416_restarts_from_zero(server: FileServer, make_cache: Callable[..., ShardCache]) -> None:
    data = blob(11)
    answers = [b"short", data]  # the first answer is shorter than what we have: 416
    server.add("/a.bin", lambda: answers.pop(0))
    shard = shard_for(data, server.url + "a.bin")
    cache = make_cache()
    (cache.root / (shard.sha256 + ".part")).write_bytes(data[:1000])
    assert cache.fetch(shard).read_bytes() == data
    assert [r[2] for r in server.requests] == ["bytes=1000-", None]


def test_lru_eviction(server: FileServer, make_cache: Callable[..., ShardCache]) -> None:
    shards = []
    for name in "abc":
        data = blob(ord(name), 1000)
        server.add(f"/{name}.bin", data)
        shards.append(shard_for(data, server.url + f"{name}.bin"))
    a, b, c = shards
    cache = make_cache(max_bytes=2000)
    cache.fetch(a)
    cache.fetch(b)
    cache.fetch(a)  # a hit: a is now the most recently used
    cache.fetch(c)
    assert cache_files(cache.root) == sorted([a.sha256, a.sha256 + ".ok", c.sha256, c.sha256 + ".ok"])
    assert cache.usage() == 2000
    assert server.count("/a.bin") == 1


def test_fetch_all_never_evicts_its_own_shards(
    server: FileServer, make_cache: Callable[..., ShardCache]
) -> None:
    shards = []
    for name in "abc":
        data = blob(ord(name), 1000)
        server.add(f"/{name}.bin", data)
        shards.append(shard_for(data, f"{name}.bin"))
    a, b, c = shards
    cache = make_cache(max_bytes=2000)
    cache.fetch_all([a, b], base_url=server.url)
    seen: list[tuple[int, int]] = []

    def progress(done: int, total: int) -> None:
        seen.append((done, total))
        if done == 1000:  # a is done: make it look like the least recently used shard
            os.utime(cache.root / a.sha256, ns=(10**9, 10**9))

    paths = cache.fetch_all([a, c], base_url=server.url, progress=progress)
    assert [p.name for p in paths] == [a.sha256, c.sha256]
    assert all(p.exists() for p in paths)
    assert not (cache.root / b.sha256).exists()
    assert seen[-1] == (2000, 2000)


def test_fetch_all_downloads_the_shards_together(
    server: FileServer, make_cache: Callable[..., ShardCache]
) -> None:
    """Each shard is answered only once all three were asked for: fetched one at a time, the first
    request would wait in vain and fail."""
    datas = [blob(40 + i, 1000) for i in range(3)]
    everyone_asked = threading.Barrier(len(datas), timeout=5)

    def answer(data: bytes) -> Callable[[], bytes]:
        return lambda: (everyone_asked.wait(), data)[1]

    for i, data in enumerate(datas):
        server.add(f"/{i}.bin", answer(data))
    shards = [shard_for(data, f"{i}.bin") for i, data in enumerate(datas)]
    paths = make_cache(retries=1).fetch_all(shards + shards[:1], base_url=server.url)
    assert [p.read_bytes() for p in paths] == datas + datas[:1]
    assert sorted(path for _, path, _ in server.requests) == ["/0.bin", "/1.bin", "/2.bin"]


def test_after_a_failed_shard_fetch_all_begins_no_other(
    server: FileServer, make_cache: Callable[..., ShardCache]
) -> None:
    """The first shard is missing; the next three take a while; the last two are never asked for
    (the set cannot be complete): the error is the missing shard's."""
    datas = [blob(60 + i, 1000) for i in range(6)]

    def slow(data: bytes) -> Callable[[], bytes]:
        return lambda: (time.sleep(0.5), data)[1]

    for i, data in enumerate(datas[1:], start=1):
        server.add(f"/{i}.bin", slow(data) if i < 4 else data)
    shards = [shard_for(data, f"{i}.bin") for i, data in enumerate(datas)]
    with pytest.raises(ShardError) as info:
        make_cache(retries=1).fetch_all(shards, base_url=server.url)
    assert info.value.code == "unreachable" and "0.bin" in info.value.message, info.value.message
    assert sorted(path for _, path, _ in server.requests) == ["/0.bin", "/1.bin", "/2.bin", "/3.bin"]


def test_fetch_all_too_large_fails_before_downloading(
    server: FileServer, make_cache: Callable[..., ShardCache]
) -> None:
    shards = [shard_for(blob(i, 1000), f"{i}.bin") for i in range(3)]
    with pytest.raises(ShardError) as info:
        make_cache(max_bytes=2500).fetch_all(shards, base_url=server.url)
    assert info.value.code == "too_large"
    assert server.requests == []


def test_shard_larger_than_cache(server: FileServer, make_cache: Callable[..., ShardCache]) -> None:
    shard = shard_for(blob(12, 1000), server.url + "big.bin")
    with pytest.raises(ShardError) as info:
        make_cache(max_bytes=999).fetch(shard)
    assert info.value.code == "too_large"
    assert shard.url in info.value.message
    assert server.requests == []


BASE = "http://127.0.0.1:9/data/"


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("file:///etc/passwd", None),
        ("file:///etc/passwd", BASE),
        ("ftp://example.org/a.bin", None),
        ("a.bin", None),
        ("../a.bin", BASE),
        ("s/%2e%2e/%2E%2E/a.bin", BASE),
        ("s/..%2fa.bin", BASE),
        ("http://example.org/s/../a.bin", None),
        ("//example.org/a.bin", BASE),
        ("/a.bin", BASE),
        ("a b.bin", BASE),
        ("http:///a.bin", None),
        ("a.bin", "file:///tmp/"),
        ("a.bin", "http://example.org/x/../"),
        ("http://example.org:99999/a.bin", None),
        ("http://[::1/a.bin", None),
        ("h\u00e9llo.bin", BASE),
        ("a.bin", "http://example.org:port/"),
    ],
)
def test_bad_urls(url: str, base: str | None, make_cache: Callable[..., ShardCache]) -> None:
    shard = Shard(url=url, sha256="0" * 64, size=10)
    with pytest.raises(ShardError) as info:
        make_cache().fetch(shard, base_url=base)
    assert info.value.code == "bad_url"
    assert url in info.value.message or (base or "") in info.value.message


@pytest.mark.parametrize(
    ("url", "base", "expected"),
    [
        ("https://example.org/a.bin?x=1", None, "https://example.org/a.bin?x=1"),
        ("https://example.org/a.bin", "http://other.example/", "https://example.org/a.bin"),
        ("s/a.bin", "http://example.org/data", "http://example.org/data/s/a.bin"),
        ("a.bin", "http://example.org/data/?token=1", "http://example.org/data/a.bin"),
    ],
)
def test_resolve_url(
    url: str, base: str | None, expected: str, make_cache: Callable[..., ShardCache]
) -> None:
    shard = Shard(url=url, sha256="0" * 64, size=10)
    assert resolve_url(shard, base) == expected
    assert make_cache().resolve_url(shard, base) == expected


def test_unreachable_server(make_cache: Callable[..., ShardCache]) -> None:
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    shard = shard_for(b"data", f"http://127.0.0.1:{port}/a.bin")
    cache = make_cache(retries=2)
    started = time.monotonic()
    with pytest.raises(ShardError) as info:
        cache.fetch(shard)
    assert time.monotonic() - started < 5
    assert info.value.code == "unreachable"
    assert shard.url in info.value.message and "2 attempts" in info.value.message


def test_missing_shard_is_unreachable(server: FileServer, make_cache: Callable[..., ShardCache]) -> None:
    shard = shard_for(b"data", server.url + "gone.bin")
    with pytest.raises(ShardError) as info:
        make_cache(retries=2).fetch(shard)
    assert info.value.code == "unreachable"
    assert "404" in info.value.message
    assert server.count("/gone.bin") == 2


def test_two_caches_on_one_directory_take_turns(server: FileServer, tmp_path: Path) -> None:
    """Two caches (as in two worker processes) share a root; flock makes the second one wait and hit."""
    data = blob(13)

    def slow() -> bytes:
        time.sleep(0.2)
        return data

    server.add("/a.bin", slow)
    shard = shard_for(data, server.url + "a.bin")
    caches = [ShardCache(tmp_path / "shared", 10 * SIZE, backoff=0.01) for _ in range(2)]
    results: list[bytes] = []
    threads = [
        threading.Thread(target=lambda c=c: results.append(c.fetch(shard).read_bytes())) for c in caches
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert results == [data, data]
    assert server.count("/a.bin") == 1


def test_file_system_errors_become_disk_error(
    server: FileServer, make_cache: Callable[..., ShardCache]
) -> None:
    data = b"0123456789"
    server.add("/a.bin", data)
    shard = shard_for(data, server.url + "a.bin")
    cache = make_cache()
    (cache.root / (shard.sha256 + ".part")).mkdir()  # something in the way that cannot be removed as a file
    with pytest.raises(ShardError) as info:
        cache.fetch(shard)
    assert info.value.code == "disk_error"
    assert shard.sha256 in info.value.message
