"""The data shard model: one shard is (URL, sha256, size), as the signed catalog lists it.

``resolve_url`` turns a shard's URL into the absolute http(s) URL to fetch, or raises
``ShardError(code="bad_url")``. The download cache is ``dedloc_core.engine.shard_cache``.
"""

from __future__ import annotations

import re
from typing import Annotated
from urllib.parse import SplitResult, unquote, urljoin, urlsplit, urlunsplit

import msgspec
from msgspec import Meta

from dedloc_core.errors import ShardError

__all__ = ["Shard", "resolve_url"]

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class Shard(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One data shard. ``url`` is absolute (http/https) or relative to the experiment's data base URL.
    Build it from untrusted data with ``msgspec.convert(data, Shard)``, which checks the lengths and
    the size; the sha256 is checked either way."""

    url: Annotated[str, Meta(min_length=1, max_length=2048)]
    sha256: str
    size: Annotated[int, Meta(gt=0, le=64 * 2**30)]

    def __post_init__(self) -> None:
        if not isinstance(self.sha256, str) or not _SHA256.fullmatch(self.sha256):  # fullmatch: "$" alone
            raise ValueError("sha256 must be 64 lowercase hex digits")  # lets a trailing newline through


def resolve_url(shard: Shard, base_url: str | None) -> str:
    """The absolute http(s) URL of ``shard``; raises ``ShardError(code="bad_url")``.

    A relative URL is a path under ``base_url`` (treated as a folder): no scheme-relative
    ``//host``, no leading ``/``, no ``..`` segments.
    """
    url = shard.url
    try:
        parts = _split(url, what="shard URL")
        if parts.scheme:
            _check_http(url, parts, what="shard URL")
            return url
        if parts.netloc or url.startswith("/"):
            raise _bad_url(url, "a relative shard URL must be a path under the data base URL")
        if base_url is None:
            raise _bad_url(url, "it is relative and the experiment gives no data base URL")
        base = _split(base_url, what="data base URL")
        _check_http(base_url, base, what="data base URL")
    except ValueError as exc:  # urlsplit and .port on malformed hosts and ports
        raise _bad_url(url, f"it cannot be parsed ({exc})") from exc
    if not base.path.endswith("/"):
        base = base._replace(path=base.path + "/")
    return urljoin(urlunsplit(base._replace(query="", fragment="")), url)


def _split(url: str, *, what: str) -> SplitResult:
    if not url.isascii() or any(ord(char) <= 0x20 or ord(char) == 0x7F for char in url):
        raise _bad_url(url, f"the {what} contains spaces, control or non-ASCII characters")
    parts = urlsplit(url)
    if ".." in re.split(r"[/\\]", unquote(parts.path)):
        raise _bad_url(url, f"the {what} contains '..' path segments")
    return parts


def _check_http(url: str, parts: SplitResult, *, what: str) -> None:
    if parts.scheme.lower() not in ("http", "https"):
        scheme = parts.scheme or "no"
        raise _bad_url(url, f"the {what} uses the {scheme!r} scheme; only http and https are allowed")
    if not parts.hostname:
        raise _bad_url(url, f"the {what} has no host")
    _ = parts.port  # raises ValueError for a port that is not a number in range


def _bad_url(url: str, why: str) -> ShardError:
    return ShardError(f"Cannot use the data shard URL {url!r}: {why}.", code="bad_url")
