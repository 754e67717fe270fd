"""A small static HTTP(S) server: the backbone serves the catalog and data shards with it, tests use it.

``FileServer`` maps URL paths to files, bytes or callables returning bytes, and can serve a
directory under a prefix (no listings, no ``..``, no hidden files, no symlinks leading out). It
answers GET and HEAD, single ``Range: bytes=…`` requests with 206 or 416 (files are streamed in
64 KiB chunks), and records every request in ``requests`` so tests can check what a client asked
for. ``add_post`` adds a POST endpoint (a callable given the request body, returning a status and a
JSON body), the backbone's ``/invite/*``: bodies over ``max_post`` get 413, and each client address
may make ``rate_burst`` POSTs at once, then ``rate_per_s`` a second (429 with ``Retry-After``).

Two hooks see the request's headers: ``guard(prefix, allow)`` answers 401 to a GET or HEAD under
``prefix`` unless ``allow(headers)`` is true (an invite-only experiment's shards), and
``add_view(path, render)`` serves ``render(headers)``, so one URL can answer members and strangers
differently (``/swarm.json``). ``bearer_token(headers)`` reads ``Authorization: Bearer <token>``.

The server is uvicorn (h11, asyncio) on a thread of its own; ``tls_cert``/``tls_key`` make it serve
HTTPS. Route callables, guards and POST handlers run on a worker thread, so a slow one holds up only
its own request. Every answer closes its connection (one request per connection).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from email.message import Message
from http import HTTPStatus
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO
from urllib.parse import unquote

__all__ = ["FileServer", "Source", "bearer_token"]

logger = logging.getLogger(__name__)

Source = Path | bytes | Callable[[], bytes]
_CHUNK = 1 << 16
_START_S = 10.0  # how long start() waits for the server to listen
_STOP_GRACE_S = 1  # how long stop() lets requests in flight finish before cancelling them
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_MAX_POST = 64 * 1024  # the largest POST body read
_DRAIN_MAX = 1 << 20  # a refused body up to this size is read and dropped, so its client reads the 413
_RATE_BURST = 30  # POSTs one client address may make at once…
_RATE_PER_S = 0.5  # …and then this many a second (a worker redeems once and renews every lifetime/2)
_MAX_CLIENTS = 10_000  # rate buckets kept; full ones are dropped first
_MAX_RECORDED = 10_000  # ``requests`` keeps the latest this many: a long-running backbone must not grow forever
Allow = Callable[[Message], bool]  # a guard: may this request (its headers) have what it asks for?
View = Callable[[Message], bytes]  # a route rendered for each request's headers
Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


def bearer_token(headers: Message) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    scheme, _, token = (headers.get("Authorization") or "").strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


@dataclass(frozen=True)
class _View:
    render: View


@dataclass(frozen=True)
class _Body:
    """What to send: an open file (or bytes), its total size and a content type."""

    size: int
    content_type: str
    data: bytes | None = None
    file: BinaryIO | None = None


def _content_type(name: str) -> str:
    suffix = PurePosixPath(name).suffix.lower()
    if suffix == ".json":
        return "application/json"
    if suffix in (".txt", ".text", ".md", ".csv", ".log", ".pub"):
        return "text/plain; charset=utf-8"
    if suffix in (".html", ".htm"):
        return "text/html; charset=utf-8"
    return "application/octet-stream"


def _number(digits: str) -> int:
    """A Range header's number; past 18 digits just "very large" (``int()`` refuses 4300+ digits)."""
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= 18 else 10**18


def _parse_range(header: str, size: int) -> tuple[int, int] | None | bool:
    """``(start, end)`` inclusive, ``None`` to ignore the header, ``False`` if unsatisfiable."""
    spec = header.replace(" ", "")
    if not spec.startswith("bytes=") or "," in spec:
        return None  # other units and multi-range requests: ignored, the full body is sent
    match = _RANGE.match(spec)
    if not match or match.group(1) == match.group(2) == "":
        return False
    first, last = match.group(1), match.group(2)
    if first == "":
        suffix = _number(last)
        if suffix == 0 or size == 0:
            return False
        return max(0, size - suffix), size - 1
    start = _number(first)
    end = size - 1 if last == "" else min(_number(last), size - 1)
    if start >= size or (last != "" and _number(last) < start):
        return False
    return start, end


def _clean_segments(raw_path: str) -> list[str] | None:
    """Decoded path segments, or ``None`` for traversal attempts and odd characters."""
    if not raw_path.startswith("/"):
        return None
    path = unquote(raw_path.split("?", 1)[0].split("#", 1)[0], errors="strict")
    if "\\" in path or "\x00" in path:
        return None
    segments = path.split("/")[1:]
    if any(segment in (".", "..") for segment in segments):
        return None
    return segments


class _Buckets:
    """A token bucket per client address: ``burst`` requests at once, then ``per_s`` a second."""

    def __init__(self, burst: int, per_s: float) -> None:
        self.burst, self.per_s = burst, per_s
        self._level: dict[str, tuple[float, float]] = {}  # client -> (tokens, when counted)

    def take(self, client: str) -> float:
        """0 if ``client`` may go on (a token is taken), else the seconds until it may."""
        now = time.monotonic()
        tokens, then = self._level.get(client, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.per_s)
        if tokens < 1:
            self._level[client] = (tokens, now)
            return (1 - tokens) / self.per_s if self.per_s > 0 else math.inf
        self._level[client] = (tokens - 1, now)
        if len(self._level) > _MAX_CLIENTS:
            self._forget_full(now)
        return 0.0

    def _forget_full(self, now: float) -> None:
        full = [c for c, (t, then) in self._level.items() if t + (now - then) * self.per_s >= self.burst]
        for client in full or list(self._level)[: len(self._level) // 2]:
            del self._level[client]


def _handle_error(method: str, path: str) -> None:
    """A request failed in this module's own code (a bug): logged with its traceback."""
    logger.exception("%s %s failed", method, path)


def _headers(scope: dict[str, Any]) -> Message:
    headers = Message()
    for name, value in scope["headers"]:
        headers[name.decode("latin-1")] = value.decode("latin-1")
    return headers


class _App:
    """The ASGI application: one request, one answer, then the connection closes."""

    def __init__(self, owner: FileServer) -> None:
        self.owner = owner

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        method = scope["method"]
        target = scope["raw_path"].decode("latin-1")
        if scope["query_string"]:
            target += "?" + scope["query_string"].decode("latin-1")
        headers = _headers(scope)
        try:
            if method in ("GET", "HEAD"):
                await self._serve(method, target, headers, receive, send)
            elif method == "POST":
                await self._post(target, headers, scope, receive, send)
            else:
                self.owner._record(method, target, None)
                await _status_only(send, HTTPStatus.NOT_IMPLEMENTED)
        except Exception:
            _handle_error(method, target)
            raise

    async def _serve(self, method: str, target: str, headers: Message, receive: Receive, send: Send) -> None:
        owner = self.owner
        range_header = headers.get("Range")
        owner._record(method, target, range_header)
        refusal = await asyncio.to_thread(owner._refused, target, headers)
        if refusal is not None:
            await _status_only(send, HTTPStatus.UNAUTHORIZED, {"WWW-Authenticate": "Bearer"}, refusal)
            return
        try:
            body = await asyncio.to_thread(owner._open, target, headers)
        except Exception:  # a callable route failed: the client sees a 500, the log has the cause
            logger.exception("route %s failed", target)
            await _status_only(send, HTTPStatus.INTERNAL_SERVER_ERROR)
            return
        if body is None:
            await _status_only(send, HTTPStatus.NOT_FOUND)
            return
        try:
            await _send(
                send, receive, body, range_header if owner.ranges else None, ranges=owner.ranges, head=method == "HEAD"
            )
        finally:
            if body.file is not None:
                body.file.close()

    async def _post(self, target: str, headers: Message, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        owner = self.owner
        owner._record("POST", target, None)
        path = owner._path(target)
        with owner._lock:
            handler = owner._posts.get(path) if path is not None else None
        if handler is None:
            await _status_only(send, HTTPStatus.NOT_FOUND)
            return
        wait = owner._buckets.take(scope["client"][0] if scope.get("client") else "")
        if wait > 0:
            await _status_only(
                send,
                HTTPStatus.TOO_MANY_REQUESTS,
                {"Retry-After": str(math.ceil(wait))},
                "too many requests from this address; try again later",
            )
            return
        length_text = headers.get("Content-Length") or ""
        length = int(length_text) if length_text.isdigit() else -1  # h11 refuses malformed lengths
        if length > owner.max_post:
            if length <= _DRAIN_MAX:  # a client still writing its body would see the close, not the 413
                await _drain(receive)
            await _status_only(send, HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            return
        if length < 0:
            await _status_only(send, HTTPStatus.LENGTH_REQUIRED)
            return
        data = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            data += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            status, payload = await asyncio.to_thread(handler, bytes(data))
        except Exception:  # a handler failed: the client sees a 500, the log has the cause
            logger.exception("POST %s failed", target)
            await _status_only(send, HTTPStatus.INTERNAL_SERVER_ERROR)
            return
        await _respond(send, status, {"Content-Type": "application/json"}, payload)


async def _drain(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body"):
            return


async def _respond(
    send: Send, status: int, headers: dict[str, str], payload: bytes, *, length: int | None = None, more: bool = False
) -> None:
    fields = [(b"Content-Length", str(len(payload) if length is None else length).encode())]
    fields += [(name.encode(), value.encode("latin-1")) for name, value in headers.items()]
    fields.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": int(status), "headers": fields})
    await send({"type": "http.response.body", "body": payload, "more_body": more})


async def _status_only(send: Send, status: HTTPStatus, headers: dict[str, str] | None = None, why: str = "") -> None:
    payload = f"{status.value} {status.phrase}{': ' + why if why else ''}\n".encode()
    await _respond(send, status, {**(headers or {}), "Content-Type": "text/plain; charset=utf-8"}, payload)


async def _send(
    send: Send, receive: Receive, body: _Body, range_header: str | None, *, ranges: bool, head: bool
) -> None:
    start, end = 0, body.size - 1
    status = HTTPStatus.OK
    if range_header is not None:
        parsed = _parse_range(range_header, body.size)
        if parsed is False:
            await _status_only(
                send, HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE, {"Content-Range": f"bytes */{body.size}"}
            )
            return
        if isinstance(parsed, tuple):
            start, end = parsed
            status = HTTPStatus.PARTIAL_CONTENT
    length = max(0, end - start + 1)
    headers = {"Content-Type": body.content_type}
    if ranges:
        headers["Accept-Ranges"] = "bytes"
    if status == HTTPStatus.PARTIAL_CONTENT:
        headers["Content-Range"] = f"bytes {start}-{end}/{body.size}"
    if head or length == 0 or body.data is not None:
        payload = b"" if head or body.data is None else body.data[start : end + 1]
        await _respond(send, status, headers, payload, length=length)
        return
    assert body.file is not None
    gone = asyncio.Event()  # set when the client goes away: no point reading the rest of the file
    watcher = asyncio.ensure_future(_wait_disconnect(receive, gone))
    try:
        await _stream(send, body.file, status, headers, start, length, gone)
    finally:
        watcher.cancel()


async def _wait_disconnect(receive: Receive, gone: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def _stream(
    send: Send, file: BinaryIO, status: int, headers: dict[str, str], start: int, length: int, gone: asyncio.Event
) -> None:
    await asyncio.to_thread(file.seek, start)
    chunk = await asyncio.to_thread(file.read, min(_CHUNK, length))
    await _respond(send, status, headers, chunk, length=length, more=True)
    remaining = length - len(chunk)
    while remaining > 0 and chunk and not gone.is_set():
        chunk = await asyncio.to_thread(file.read, min(_CHUNK, remaining))
        remaining -= len(chunk)
        await send({"type": "http.response.body", "body": chunk, "more_body": remaining > 0 and bool(chunk)})
    if remaining > 0 and not gone.is_set():  # the file shrank while we sent it: the client sees a short body
        raise _Short(f"{remaining} bytes short")


class _Short(Exception):
    """A file shrank while it was sent; the connection is dropped."""


def _protocol_class() -> type:
    """uvicorn's h11 protocol, kept open for the answer when a client half-closes after its request."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        def eof_received(self) -> bool:  # type: ignore[override]
            pending = self.cycle is not None and not self.cycle.response_complete
            return pending and self.scheme == "http"  # asyncio's TLS transport cannot stay half-open

    return Protocol


class FileServer:
    """Static files over HTTP(S) on a daemon thread: ``FileServer(routes).start()`` … ``.stop()``.

    ``routes`` maps URL paths (``"/catalog.json"``) to a file, bytes, or a callable called on every
    request; the content type comes from the path's suffix, or from ``add(..., content_type=)``.
    ``tls_cert`` and ``tls_key`` (PEM files) make it serve HTTPS. ``max_post``, ``rate_burst`` and
    ``rate_per_s`` limit POST endpoints (see the module's docstring). ``ranges=False`` makes the
    server ignore ``Range`` headers (a test hook, like ``requests``: a list of ``(method, raw path,
    Range header or None)``).
    """

    def __init__(
        self,
        routes: dict[str, Source] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        ranges: bool = True,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        max_post: int = _MAX_POST,
        rate_burst: int = _RATE_BURST,
        rate_per_s: float = _RATE_PER_S,
    ) -> None:
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("HTTPS needs both a certificate (tls_cert) and its key (tls_key)")
        self.host = host
        self.port = port
        self.ranges = ranges
        self.tls_cert, self.tls_key = tls_cert, tls_key
        self.max_post = max_post
        self.requests: list[tuple[str, str, str | None]] = []
        self._routes: dict[str, Source] = {}
        self._types: dict[str, str] = {}  # route path -> content type given to add()
        self._dirs: dict[str, Path] = {}
        self._guards: dict[str, tuple[Allow, str]] = {}  # path prefix -> (allow, what a refusal says)
        self._posts: dict[str, Callable[[bytes], tuple[int, bytes]]] = {}
        self._buckets = _Buckets(rate_burst, rate_per_s)
        self._lock = threading.Lock()
        self._server: Any = None  # the uvicorn.Server while serving
        self._thread: threading.Thread | None = None
        for path, source in (routes or {}).items():
            self.add(path, source)

    # -- configuration ---------------------------------------------------------------------------

    def add(self, path: str, source: Source, content_type: str | None = None) -> None:
        """Serve ``source`` at URL ``path`` (replaces an existing route), as ``content_type`` if
        given (else guessed from the path's suffix: ``/`` needs one to be served as HTML)."""
        key = "/" + path.lstrip("/")
        if _clean_segments(key) is None:
            raise ValueError(f"bad route path: {path!r}")
        with self._lock:
            self._routes[key] = source
            if content_type is None:
                self._types.pop(key, None)
            else:
                self._types[key] = content_type

    def add_view(self, path: str, render: View, content_type: str | None = None) -> None:
        """Serve ``render(headers)`` at ``path``: the answer may depend on who asks (``bearer_token``)."""
        self.add(path, _View(render), content_type)  # type: ignore[arg-type]

    def guard(self, prefix: str, allow: Allow, message: str = "") -> None:
        """Answer GET and HEAD requests for ``prefix`` (a path, or everything under a prefix ending
        in ``/``) with 401 and ``message`` unless ``allow(headers)`` is true. ``allow`` runs on the
        serving thread for each request; an exception in it counts as a refusal."""
        key = "/" + prefix.lstrip("/")
        with self._lock:
            self._guards[key] = (allow, message)

    def add_post(self, path: str, handler: Callable[[bytes], tuple[int, bytes]]) -> None:
        """Answer ``POST path`` with ``handler(body) -> (status, JSON bytes)``: bodies up to ``max_post``,
        at the rate each client address is allowed (``rate_burst``, ``rate_per_s``)."""
        key = "/" + path.lstrip("/")
        with self._lock:
            self._posts[key] = handler

    def serve_dir(self, prefix: str, directory: Path) -> None:
        """Serve the regular, non-hidden files under ``directory`` at ``/prefix/…``."""
        key = "/" + prefix.strip("/") + "/" if prefix.strip("/") else "/"
        with self._lock:
            self._dirs[key] = Path(directory).resolve()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> FileServer:
        """Bind, then serve on a daemon thread; returns ``self`` once it listens. A bad certificate
        or key raises here (``ssl.SSLError`` or ``OSError``)."""
        if self._server is not None:
            return self
        import uvicorn

        config = uvicorn.Config(
            _App(self),
            loop="asyncio",
            http=_protocol_class(),
            ws="none",
            lifespan="off",
            interface="asgi3",
            log_config=None,
            access_log=False,
            proxy_headers=False,
            server_header=False,
            timeout_graceful_shutdown=_STOP_GRACE_S,
            ssl_certfile=str(self.tls_cert) if self.tls_cert else None,
            ssl_keyfile=str(self.tls_key) if self.tls_key else None,
        )
        config.load()  # the TLS context too: a bad certificate fails on the caller's thread
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="FileServer", daemon=True)
        thread.start()
        deadline = time.monotonic() + _START_S
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        if not server.started:
            server.should_exit = True
            thread.join(timeout=5)
            sock.close()
            raise OSError(f"the HTTP server on {self.host}:{self.port} did not start")
        self._server, self._thread = server, thread
        logger.debug("serving on %s", self.url)
        return self

    @property
    def url(self) -> str:
        """The base URL with a trailing slash, e.g. ``https://127.0.0.1:8123/``."""
        if self._server is None:
            raise RuntimeError("FileServer is not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        scheme = "https" if self.tls_cert else "http"
        return f"{scheme}://{host}:{self.port}/"

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent); answers in flight get a moment to finish."""
        server, self._server = self._server, None
        if server is None:
            return
        server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=_STOP_GRACE_S + 5)
            self._thread = None

    def __enter__(self) -> FileServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- test hooks ------------------------------------------------------------------------------

    def count(self, path: str, method: str | None = None) -> int:
        """How many requests were made for the raw ``path`` (optionally only with ``method``)."""
        with self._lock:
            return sum(1 for m, p, _ in self.requests if p == path and method in (None, m))

    def _record(self, method: str, path: str, range_header: str | None) -> None:
        with self._lock:
            self.requests.append((method, path, range_header))
            if len(self.requests) > _MAX_RECORDED:
                del self.requests[: len(self.requests) - _MAX_RECORDED // 2]

    # -- lookup ----------------------------------------------------------------------------------

    @staticmethod
    def _path(raw_path: str) -> str | None:
        try:
            segments = _clean_segments(raw_path)
        except UnicodeDecodeError:
            return None
        return None if segments is None else "/" + "/".join(segments)

    def _refused(self, raw_path: str, headers: Message) -> str | None:
        """Why the request is refused (its guard said no), or None when no guard refuses it."""
        path = self._path(raw_path)
        if path is None:
            return None  # answered 404 by _open
        with self._lock:
            guards = [
                (allow, message)
                for prefix, (allow, message) in self._guards.items()
                if path == prefix or (prefix.endswith("/") and path.startswith(prefix))
            ]
        for allow, message in guards:
            try:
                allowed = allow(headers)
            except Exception:  # a failing check never lets a request through
                logger.exception("the guard of %s failed", raw_path)
                allowed = False
            if not allowed:
                return message or "an access token is needed"
        return None

    def _open(self, raw_path: str, headers: Message | None = None) -> _Body | None:
        path = self._path(raw_path)
        if path is None:
            return None
        with self._lock:
            source = self._routes.get(path)
            content_type = self._types.get(path)
            dirs = list(self._dirs.items())
        if isinstance(source, _View):
            data = source.render(headers if headers is not None else Message())
            return _Body(size=len(data), content_type=content_type or _content_type(path), data=bytes(data))
        if source is not None:
            return self._open_source(source, path, content_type)
        for prefix, root in sorted(dirs, key=lambda item: -len(item[0])):
            if path.startswith(prefix):
                return self._open_in_dir(root, path[len(prefix) :])
        return None

    @staticmethod
    def _open_source(source: Source, path: str, content_type: str | None = None) -> _Body | None:
        if isinstance(source, Path):
            name = path if PurePosixPath(path).suffix else source.name
            return _open_file(source, content_type or _content_type(name))
        data = source if isinstance(source, bytes) else source()
        return _Body(size=len(data), content_type=content_type or _content_type(path), data=bytes(data))

    @staticmethod
    def _open_in_dir(root: Path, relative: str) -> _Body | None:
        parts = relative.split("/")
        if not relative or any(not part or part.startswith(".") for part in parts):
            return None
        candidate = root.joinpath(*parts)
        try:
            resolved = candidate.resolve(strict=True)
        except (OSError, RuntimeError):
            return None
        if not resolved.is_relative_to(root):
            return None
        return _open_file(resolved, _content_type(relative))


def _open_file(path: Path, content_type: str) -> _Body | None:
    """An open regular file, or ``None`` for anything else (missing, a directory, a FIFO, a device)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # checked first: opening a FIFO would block
            return None
        handle = open(path, "rb")  # closed by the handler after sending
    except OSError:
        return None
    size = os.fstat(handle.fileno()).st_size
    return _Body(size=size, content_type=content_type, file=handle)
