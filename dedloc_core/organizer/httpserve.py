"""A small static HTTP server: the backbone serves the catalog and data shards with it, tests use it.

``FileServer`` maps URL paths to files, bytes or callables returning bytes, and can serve a
directory under a prefix (no listings, no ``..``, no hidden files, no symlinks leading out). It
answers GET and HEAD, single ``Range: bytes=…`` requests with 206 or 416, and records every
request in ``requests`` so tests can check what a client asked for. ``add_post`` adds a POST endpoint
(a callable given the request body, returning a status and a JSON body), the backbone's ``/invite/*``.

Two hooks see the request's headers: ``guard(prefix, allow)`` answers 401 to a GET or HEAD under
``prefix`` unless ``allow(headers)`` is true (an invite-only experiment's shards), and
``add_view(path, render)`` serves ``render(headers)``, so one URL can answer members and strangers
differently (``/swarm.json``). ``bearer_token(headers)`` reads ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from email.message import Message
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from typing import BinaryIO
from urllib.parse import unquote

__all__ = ["FileServer", "Source", "bearer_token"]

logger = logging.getLogger(__name__)

Source = Path | bytes | Callable[[], bytes]
_CHUNK = 1 << 16
_POLL_S = 0.05  # how long stop() may wait for the serving loop to notice
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_MAX_POST = 64 * 1024  # the largest POST body read
_MAX_RECORDED = 10_000  # ``requests`` keeps the latest this many: a long-running backbone must not grow forever
Allow = Callable[[Message], bool]  # a guard: may this request (its headers) have what it asks for?
View = Callable[[Message], bytes]  # a route rendered for each request's headers


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


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    owner: FileServer


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    server_version = "dedloc-fileserver"
    sys_version = ""

    # Never answer in HTTP/0.9 (a bare body: no status line, no headers; for HEAD, nothing at all),
    # neither to a request line too malformed to give a version nor to one that asks for 0.9.
    _request_version = "HTTP/1.0"

    @property
    def request_version(self) -> str:
        return self._request_version

    @request_version.setter
    def request_version(self, version: str) -> None:
        self._request_version = "HTTP/1.0" if version == "HTTP/0.9" else version

    def log_message(self, format: str, *args: object) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_POST(self) -> None:
        owner = self.server.owner
        owner._record("POST", self.path, None)
        try:
            segments = _clean_segments(self.path)
        except UnicodeDecodeError:
            segments = None
        handler = owner._posts.get("/" + "/".join(segments)) if segments is not None else None
        if handler is None:
            self._status_only(HTTPStatus.NOT_FOUND)
            return
        try:
            length = int(self.headers.get("Content-Length") or "-1")
        except ValueError:
            length = -1
        if not 0 <= length <= _MAX_POST:
            self._status_only(HTTPStatus.REQUEST_ENTITY_TOO_LARGE if length > _MAX_POST else HTTPStatus.LENGTH_REQUIRED)
            return
        try:
            status, payload = handler(self.rfile.read(length))
        except Exception:  # a handler failed: the client sees a 500, the log has the cause
            logger.exception("POST %s failed", self.path)
            self._status_only(HTTPStatus.INTERNAL_SERVER_ERROR)
            return
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _serve(self, *, head: bool) -> None:
        owner = self.server.owner
        range_header = self.headers.get("Range")
        owner._record(self.command, self.path, range_header)
        refusal = owner._refused(self.path, self.headers)
        if refusal is not None:
            self._status_only(HTTPStatus.UNAUTHORIZED, {"WWW-Authenticate": "Bearer"}, refusal)
            return
        try:
            body = owner._open(self.path, self.headers)
        except Exception:  # a callable route failed: the client sees a 500, the log has the cause
            logger.exception("route %s failed", self.path)
            self._status_only(HTTPStatus.INTERNAL_SERVER_ERROR)
            return
        if body is None:
            self._status_only(HTTPStatus.NOT_FOUND)
            return
        try:
            self._send(body, range_header if owner.ranges else None, head=head)
        except (BrokenPipeError, ConnectionResetError):
            logger.debug("client %s went away", self.address_string())
        finally:
            if body.file is not None:
                body.file.close()

    def _status_only(self, status: HTTPStatus, headers: dict[str, str] | None = None, why: str = "") -> None:
        payload = f"{status.value} {status.phrase}{': ' + why if why else ''}\n".encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _send(self, body: _Body, range_header: str | None, *, head: bool) -> None:
        start, end = 0, body.size - 1
        status = HTTPStatus.OK
        if range_header is not None:
            parsed = _parse_range(range_header, body.size)
            if parsed is False:
                self._status_only(
                    HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE, {"Content-Range": f"bytes */{body.size}"}
                )
                return
            if isinstance(parsed, tuple):
                start, end = parsed
                status = HTTPStatus.PARTIAL_CONTENT
        length = end - start + 1
        self.send_response(status)
        self.send_header("Content-Type", body.content_type)
        self.send_header("Content-Length", str(length))
        if self.server.owner.ranges:
            self.send_header("Accept-Ranges", "bytes")
        if status == HTTPStatus.PARTIAL_CONTENT:
            self.send_header("Content-Range", f"bytes {start}-{end}/{body.size}")
        self.end_headers()
        if head or length <= 0:
            return
        if body.data is not None:
            self.wfile.write(body.data[start : end + 1])
            return
        assert body.file is not None
        body.file.seek(start)
        remaining = length
        while remaining > 0:
            chunk = body.file.read(min(_CHUNK, remaining))
            if not chunk:
                break  # the file shrank while we sent it; the client sees a short body
            self.wfile.write(chunk)
            remaining -= len(chunk)


class FileServer:
    """Static files over HTTP on a daemon thread: ``FileServer(routes).start()`` … ``.stop()``.

    ``routes`` maps URL paths (``"/catalog.json"``) to a file, bytes, or a callable called on every
    request; the content type comes from the path's suffix, or from ``add(..., content_type=)``.
    ``ranges=False`` makes the server ignore ``Range`` headers (a test hook, like
    ``requests``: a list of ``(method, raw path, Range header or None)``).
    """

    def __init__(
        self,
        routes: dict[str, Source] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        ranges: bool = True,
    ) -> None:
        self.host = host
        self.port = port
        self.ranges = ranges
        self.requests: list[tuple[str, str, str | None]] = []
        self._routes: dict[str, Source] = {}
        self._types: dict[str, str] = {}  # route path -> content type given to add()
        self._dirs: dict[str, Path] = {}
        self._guards: dict[str, tuple[Allow, str]] = {}  # path prefix -> (allow, what a refusal says)
        self._posts: dict[str, Callable[[bytes], tuple[int, bytes]]] = {}
        self._lock = threading.Lock()
        self._httpd: _HTTPServer | None = None
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
        """Answer ``POST path`` with ``handler(body) -> (status, JSON bytes)`` (bodies up to 64 KiB)."""
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
        """Bind and serve on a daemon thread. Returns ``self``."""
        if self._httpd is not None:
            return self
        server_class = _HTTPServer
        if ":" in self.host:
            server_class = type("_HTTPServer6", (_HTTPServer,), {"address_family": socket.AF_INET6})
        httpd = server_class((self.host, self.port), _Handler)
        httpd.owner = self
        self.port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": _POLL_S}, name="FileServer", daemon=True
        )
        self._thread.start()
        logger.debug("serving on %s", self.url)
        return self

    @property
    def url(self) -> str:
        """The base URL with a trailing slash, e.g. ``http://127.0.0.1:8123/``."""
        if self._httpd is None:
            raise RuntimeError("FileServer is not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def stop(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
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
            guards = [(allow, message) for prefix, (allow, message) in self._guards.items()
                      if path == prefix or (prefix.endswith("/") and path.startswith(prefix))]
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
