"""Data shards: (URL, sha256, size), fetched into a bounded, verified cache.

``Shard`` (``dedloc_core.catalog.shards``) describes one shard, as the signed catalog lists it;
``ShardCache.fetch`` returns a local, verified copy or raises ``ShardError`` with one of these codes:

    bad_url      the URL is not http(s), is relative without a base, or has ``..`` segments
    too_large    the shard (or the set asked for together) does not fit in the cache
    corrupt      the server kept sending bytes that do not match the sha256 and size
    unreachable  the server could not be reached or the download kept breaking off
    disk_error   the cache directory cannot be written
    refused      the server answered 401 or 403: an invite-only experiment's data needs a member's
                 token (``ShardCache(token=...)``, sent as ``Authorization: Bearer``), and it had none
                 or refused it; never retried
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, BinaryIO
from urllib.error import HTTPError, URLError
from urllib.parse import urlsplit
from urllib.request import HTTPRedirectHandler, Request, build_opener

from dedloc_core.catalog.shards import Shard, resolve_url
from dedloc_core.errors import ShardError
from dedloc_core.invites import plain_http_refusal

try:
    import fcntl
except ImportError:  # Windows: the worker does not run there; threads still take turns
    fcntl = None  # type: ignore[assignment]

__all__ = ["Progress", "Shard", "ShardCache", "fetch_in_background", "resolve_url"]

logger = logging.getLogger(__name__)


# -- the cache ---------------------------------------------------------------------------------------

Progress = Callable[[int, int], None]

PARALLEL = 4  # shards downloaded at once by fetch_all
_CHUNK = 1 << 16
_HASH_CHUNK = 1 << 20
_NAME = re.compile(r"^([0-9a-f]{64})(\.part)?$")
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_USER_AGENT = "dedloc-volunteer-shards/1"


class _Mismatch(Exception):
    """The bytes we got are not the shard: start over from zero."""


class _Unreachable(Exception):
    """A network failure: retry, resuming what we have."""


class _Skipped(Exception):
    """A shard of a set that already failed, not begun (``fetch_all``)."""


class _Refused(Exception):
    """The server refused us (401, 403): asking again with the same token gets the same answer."""


class _HttpOnlyRedirects(HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        if urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise HTTPError(newurl, code, f"redirect to a non-http URL: {newurl}", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class ShardCache:
    """A bounded, content-addressed cache of verified shards under ``root``.

    Files are named by sha256: ``<sha>`` (complete, verified), ``<sha>.part`` (a download to
    resume), ``<sha>.ok`` (size, mtime, ctime and inode of ``<sha>`` when it last verified, so a hit
    need not re-hash). One lock (a ``threading.Lock`` and ``flock`` on ``root/.lock``) covers each
    fetch (``fetch_all``'s downloads run together under it), so threads and processes sharing a
    cache take turns. The least recently used shards are evicted to stay under ``max_bytes``.
    """

    def __init__(
        self,
        root: Path,
        max_bytes: int,
        *,
        retries: int = 3,
        timeout: float = 30,
        backoff: float = 1.0,
        token: str | None = None,
    ) -> None:
        if max_bytes <= 0 or retries < 1:
            raise ValueError("max_bytes must be positive and retries at least 1")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.retries = retries
        self.timeout = timeout
        self.backoff = backoff
        self.token = token  # an invite-only experiment's access token, sent with every request
        self.root.mkdir(parents=True, exist_ok=True)
        self._thread_lock = threading.Lock()
        self._opener = build_opener(_HttpOnlyRedirects)

    resolve_url = staticmethod(resolve_url)

    def fetch(self, shard: Shard, base_url: str | None = None, progress: Progress | None = None) -> Path:
        """The local path of ``shard``, verified; downloaded (or resumed) if needed."""
        url = resolve_url(shard, base_url)
        with self._locked():
            return self._fetch(shard, url, progress, protect={shard.sha256})

    def fetch_all(
        self, shards: Sequence[Shard], base_url: str | None = None, progress: Progress | None = None
    ) -> list[Path]:
        """``fetch`` each shard, ``PARALLEL`` at a time; none of them evicts another. ``progress``
        sees the whole set. One connection at a time would leave a long link idle: each shard
        pays its connect, its request and TCP's slow start (about 0.7 s for 600 kB at 100 ms)."""
        urls = [resolve_url(shard, base_url) for shard in shards]
        unique: dict[str, tuple[Shard, str]] = {}
        for shard, url in zip(shards, urls, strict=True):
            unique.setdefault(shard.sha256, (shard, url))
        total = sum(shard.size for shard, _ in unique.values())
        if total > self.max_bytes:
            raise ShardError(
                f"The {len(unique)} data shards need {total} bytes together, more than the shard cache "
                f"may hold ({self.max_bytes} bytes). Allow a larger cache in the settings.",
                code="too_large",
            )
        protect = set(unique)
        done = dict.fromkeys(unique, 0)
        progress_lock = threading.Lock()
        failed = threading.Event()  # after a failure no shard begins: the set is lost anyway

        def fetch_one(sha: str) -> Path:
            shard, url = unique[sha]

            def report(now: int, _: int) -> None:
                assert progress is not None
                with progress_lock:
                    done[sha] = now
                    progress(sum(done.values()), total)

            if failed.is_set():
                raise _Skipped
            try:
                return self._fetch(shard, url, report if progress is not None else None, protect=protect)
            except BaseException:
                failed.set()
                raise

        with self._locked():
            with ThreadPoolExecutor(max_workers=min(PARALLEL, len(unique)) or 1, thread_name_prefix="shard") as pool:
                futures = {sha: pool.submit(fetch_one, sha) for sha in unique}
            errors = [future.exception() for future in futures.values()]
            first = next((e for e in errors if e is not None and not isinstance(e, _Skipped)), None)
            if first is not None:  # the first failure in the set's order
                raise first
            paths = {sha: future.result() for sha, future in futures.items()}
        return [paths[shard.sha256] for shard in shards]

    def usage(self) -> int:
        """Bytes held by complete shards and partial downloads."""
        with self._locked():
            return sum(size for _, _, size, _ in self._entries())

    # -- internals -------------------------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the cache; file system errors in the block become ``ShardError("disk_error")``."""
        try:
            with self._thread_lock, open(self.root / ".lock", "a+b") as handle:
                if fcntl is not None:
                    fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
                try:
                    yield
                finally:
                    if fcntl is not None:
                        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        except OSError as exc:
            where = exc.filename or self.root
            raise ShardError(
                f"Cannot use the data shard cache ({where}): {exc.strerror or exc}. "
                "Check the free disk space and the permissions of the cache folder.",
                code="disk_error",
            ) from exc

    def _fetch(self, shard: Shard, url: str, progress: Progress | None, *, protect: set[str]) -> Path:
        final = self.root / shard.sha256
        if self._valid(shard, final):
            _touch(final)
            self._write_marker(final)
            if progress is not None:
                progress(shard.size, shard.size)
            return final
        if shard.size > self.max_bytes:
            raise ShardError(
                f"The data shard {url} is {shard.size} bytes, more than the whole shard cache may hold "
                f"({self.max_bytes} bytes). Allow a larger cache in the settings.",
                code="too_large",
            )
        part = final.with_name(shard.sha256 + ".part")
        failure = ""
        code = "unreachable"
        for attempt in range(self.retries):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), 30.0))
            try:
                self._make_room(shard, protect)
                self._download(shard, url, part, progress)
                os.replace(part, final)
                _touch(final)
                self._write_marker(final)
                return final
            except _Mismatch as exc:
                part.unlink(missing_ok=True)
                failure, code = str(exc), "corrupt"
            except _Unreachable as exc:
                failure, code = str(exc), "unreachable"
            except _Refused as exc:
                raise _refusal(url, str(exc), self.token is not None) from None
            logger.warning("shard %s, attempt %d of %d: %s", url, attempt + 1, self.retries, failure)
        if code == "corrupt":
            message = (
                f"The data shard {url} failed verification {self.retries} times ({failure}). The server "
                "is not serving the data the experiment describes; it was discarded."
            )
        else:
            message = f"Could not download the data shard {url} after {self.retries} attempts: {failure}."
        raise ShardError(message, code=code)

    def _download(self, shard: Shard, url: str, part: Path, progress: Progress | None) -> None:
        """Fill ``part`` with the verified shard, resuming it if it exists."""
        offset = part.stat().st_size if part.exists() else 0
        if offset > shard.size:
            part.unlink()
            offset = 0
        if offset == shard.size:  # a finished download that was never renamed
            _verify(shard, _hash_file(part), offset)
            return
        response = self._open(url, offset)
        with response:
            if response.status == 200:
                offset = 0
            elif response.status == 206:
                _check_content_range(response.headers.get("Content-Range"), offset, shard.size)
            else:
                raise _Unreachable(f"unexpected HTTP status {response.status}")
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and offset + int(length) != shard.size:
                raise _Mismatch(f"the server sends {offset + int(length)} bytes, expected {shard.size}")
            with open(part, "r+b" if offset else "wb") as out:
                out.truncate(offset)
                digest = _hash_file(part, out) if offset else hashlib.sha256()
                out.seek(offset)
                done = offset
                if progress is not None:
                    progress(done, shard.size)
                while done < shard.size:
                    chunk = _read(response, min(_CHUNK, shard.size - done))
                    if not chunk:
                        raise _Unreachable(f"the connection closed after {done} of {shard.size} bytes")
                    out.write(chunk)
                    digest.update(chunk)
                    done += len(chunk)
                    if progress is not None:
                        progress(done, shard.size)
                if _read(response, 1):
                    raise _Mismatch(f"the server sends more than the expected {shard.size} bytes")
                out.flush()
                os.fsync(out.fileno())
        _verify(shard, digest, done)

    def _open(self, url: str, offset: int) -> Any:
        """An HTTP response for ``url`` from ``offset`` on (a 416 restarts from zero)."""
        headers = {"User-Agent": _USER_AGENT, "Accept-Encoding": "identity"}
        if offset:
            headers["Range"] = f"bytes={offset}-"
        request = Request(url, headers=headers)
        if self.token:  # never sent on to wherever a redirect points
            refusal = plain_http_refusal(url, "an access token")
            if refusal is not None:  # checked before connecting: the token never leaves this computer
                raise ShardError(refusal, title="Training data refused", code="refused",
                                 hint="Tell the experiment's organizer: members-only data needs an https:// server.")
            request.add_unredirected_header("Authorization", f"Bearer {self.token}")
        try:
            return self._opener.open(request, timeout=self.timeout)
        except HTTPError as exc:
            why = _short_text(exc)
            exc.close()
            if exc.code == 416 and offset:
                return self._open(url, 0)
            if exc.code in (401, 403):
                raise _Refused(f"HTTP {exc.code} {exc.reason}{': ' + why if why else ''}") from exc
            raise _Unreachable(f"HTTP {exc.code} {exc.reason}") from exc
        except (OSError, http.client.HTTPException) as exc:
            reason = exc.reason if isinstance(exc, URLError) else exc
            raise _Unreachable(f"{reason or type(exc).__name__}") from exc

    def _valid(self, shard: Shard, final: Path) -> bool:
        """Whether ``final`` holds the shard; a damaged copy is deleted."""
        marker = final.with_name(shard.sha256 + ".ok")
        try:
            info = final.stat()
        except FileNotFoundError:
            marker.unlink(missing_ok=True)
            return False
        if info.st_size == shard.size:
            try:
                if marker.read_text() == _stamp(info):
                    return True
            except OSError:
                pass
            try:
                _verify(shard, _hash_file(final), info.st_size)
                return True
            except _Mismatch as exc:
                logger.warning("cached shard %s is damaged (%s); fetching it again", final.name, exc)
        final.unlink()
        marker.unlink(missing_ok=True)
        return False

    def _write_marker(self, final: Path) -> None:
        final.with_name(final.name + ".ok").write_text(_stamp(final.stat()))

    def _entries(self) -> list[tuple[float, Path, int, str]]:
        """``(last use, path, size, sha)`` of every complete shard and partial download."""
        entries = []
        for path in self.root.iterdir():
            match = _NAME.match(path.name)
            if match is None:
                continue
            try:
                info = path.stat()
            except FileNotFoundError:
                continue
            entries.append((info.st_mtime_ns, path, info.st_size, match.group(1)))
        return sorted(entries, key=lambda entry: entry[0])

    def _make_room(self, shard: Shard, protect: set[str]) -> None:
        """Evict least recently used files until ``shard`` fits; its own ``.part`` counts as its."""
        entries = [entry for entry in self._entries() if entry[3] != shard.sha256]
        used = sum(size for _, _, size, _ in entries)
        for _, path, size, sha in entries:
            if used + shard.size <= self.max_bytes:
                return
            if sha in protect:
                continue
            logger.info("evicting shard %s (%d bytes) from the cache", path.name, size)
            path.unlink(missing_ok=True)
            path.with_name(sha + ".ok").unlink(missing_ok=True)
            used -= size
        if used + shard.size > self.max_bytes:
            raise ShardError(
                f"The shard cache ({self.max_bytes} bytes) is full of shards in use; "
                "allow a larger cache in the settings.",
                code="too_large",
            )


def _short_text(exc: HTTPError) -> str:
    """The first line of an error's plain-text body (at most 200 characters), or ""."""
    try:
        if not (exc.headers.get("Content-Type") or "").startswith("text/plain"):
            return ""
        return exc.read(200).decode("utf-8", "replace").strip().splitlines()[0]
    except (OSError, IndexError, http.client.HTTPException):
        return ""


def _refusal(url: str, answer: str, had_token: bool) -> ShardError:
    if had_token:
        message = (f"The server refused this computer's access token for the data shard {url} ({answer}).")
        hint = "The access token may have expired or been revoked; the app asks for a new one when it rejoins."
    else:
        message = f"The server refused the data shard {url} without an access token ({answer})."
        hint = ("This experiment's data is for its invited members: join it with an invite code, or ask the "
                "organizer to mark its data public in the catalog.")
    return ShardError(message, title="Training data refused", code="refused", hint=hint)


def _read(response: Any, size: int) -> bytes:
    try:
        return bytes(response.read(size))
    except (OSError, http.client.HTTPException) as exc:
        raise _Unreachable(f"the download broke off: {exc or type(exc).__name__}") from exc


def _check_content_range(header: str | None, offset: int, size: int) -> None:
    match = _CONTENT_RANGE.match(header or "")
    if match is None or int(match.group(1)) != offset:
        raise _Unreachable(f"the server answered a resume from byte {offset} with range {header!r}")
    if match.group(3) != "*" and int(match.group(3)) != size:
        raise _Mismatch(f"the server has {match.group(3)} bytes, expected {size}")


def _hash_file(path: Path, handle: BinaryIO | None = None) -> hashlib._Hash:
    digest = hashlib.sha256()
    with open(path, "rb") if handle is None else nullcontext(handle) as source:
        source.seek(0)
        while chunk := source.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest


def _verify(shard: Shard, digest: hashlib._Hash, size: int) -> None:
    if size != shard.size or digest.hexdigest() != shard.sha256:
        raise _Mismatch(
            f"got {size} bytes with sha256 {digest.hexdigest()}, expected {shard.size} bytes "
            f"with sha256 {shard.sha256}"
        )


def _stamp(info: os.stat_result) -> str:
    return f"{info.st_size} {info.st_mtime_ns} {info.st_ctime_ns} {info.st_ino}\n"


def _touch(path: Path) -> None:
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def fetch_in_background(shards: Sequence[Shard], base_url: str | None,
                        token: Callable[[], str | None] | None = None) -> Future:
    """``fetch_all`` into the worker's cache on a thread (the worker imports torch and hivemind
    meanwhile): a future of the local paths; ``result()`` raises what the fetch raised. ``token``,
    called on that thread first, gives the access token an invite-only experiment's data needs
    (what it raises, the future raises)."""
    from dedloc_core import environ, paths

    future: Future = Future()

    def run() -> None:
        try:
            limit = environ.CACHE_BYTES.integer()
            cache = ShardCache(paths.cache_dir() / "shards", max_bytes=limit, token=token() if token else None)
            future.set_result(cache.fetch_all(shards, base_url))
        except BaseException as exc:  # handed to whoever waits for the data
            future.set_exception(exc)

    threading.Thread(target=run, name="fetch-data", daemon=True).start()
    return future
