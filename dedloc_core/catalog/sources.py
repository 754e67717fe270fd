"""Catalog sources: where experiments come from, each a catalog URL pinned to its organizer's key.

The project's own source is built in (``resources/catalog/project_source.json``: its URL, set at
build time, and the shipped key; with no URL or no network the shipped catalog is used quietly).
A volunteer adds others from an organizer's link, ``dedloc://add?url=<catalog URL>&key=<base64
Ed25519 public key>``, or from a URL and a key fingerprint (the key is then fetched from
``catalog.pub`` next to the catalog and must match the fingerprint). A source's catalog is
verified with its pinned key only: one signed by any other key is refused, and the source's last
good copy stays. The list lives in ``sources.json`` in the config folder (versioned, written
atomically; a broken file is kept aside and the built-in source alone is used).

``DEDLOC_CATALOG_URL`` (with ``DEDLOC_TRUSTED_KEYS``) replaces the built-in source, for tests and
organizers trying their own catalog.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated
from urllib.parse import parse_qs, urljoin, urlsplit

import msgspec
from msgspec import Meta

from dedloc_core import paths
from dedloc_core.errors import CatalogError
from dedloc_core.schema import describe

from .model import Catalog, catalog_error
from .signing import verify_catalog
from .store import CatalogStore, LoadResult, SourceState, fetch_catalog

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

__all__ = ["Source", "SourceList", "add_link", "builtin_source", "fetch_key", "fingerprint", "inspect", "merge",
           "organizer_of", "parse_link", "refresh_source"]

logger = logging.getLogger(__name__)

SOURCES_VERSION = 1
FILE_NAME = "sources.json"
SCHEME = "dedloc"
MAX_KEY_BYTES = 4096


def fingerprint(key_b64: str) -> str:
    """The key id shown to people: the first 16 hex digits of sha256 of the raw 32-byte key."""
    return hashlib.sha256(_raw_key(key_b64)).hexdigest()[:16]


def _raw_key(key_b64: str) -> bytes:
    try:
        raw = base64.b64decode(key_b64, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        raise catalog_error("bad_key", "The organizer's key is not an Ed25519 public key (32 bytes, base64).")
    return raw


def _check_url(url: str) -> str:
    try:
        parts = urlsplit(url)
        ok = parts.scheme.lower() in ("http", "https") and bool(parts.hostname)
        _ = parts.port  # raises ValueError for a port that is not a number in range
    except ValueError:  # urlsplit on a malformed host ("http://[x]/"), .port out of range
        ok = False
    if not ok:
        raise catalog_error("bad_url", f"The catalog URL {url!r} must be an http or https URL.")
    return url


class Source(msgspec.Struct, frozen=True):
    """One catalog source: a URL and the organizer key it is pinned to. The URL and the key are
    checked however it is made (a bad one raises ValueError); the lengths when it is read from a file."""

    url: Annotated[str, Meta(max_length=2048)]
    key: Annotated[str, Meta(max_length=64, description="base64 of the raw Ed25519 public key")]
    name: Annotated[str, Meta(max_length=200, description="the organizer, as the catalog names it")] = ""
    builtin: bool = False
    added_at: float = 0.0

    def __post_init__(self) -> None:
        try:
            _check_url(self.url)
            _raw_key(self.key)
        except CatalogError as exc:
            raise ValueError(exc.message) from None

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.key)

    @property
    def ident(self) -> str:
        """A short, stable name for this source's files (its last good catalog)."""
        return hashlib.sha256(self.url.encode()).hexdigest()[:16]

    def public_key(self) -> Ed25519PublicKey:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        return Ed25519PublicKey.from_public_bytes(_raw_key(self.key))

    def label(self) -> str:
        return self.name or urlsplit(self.url).hostname or self.url


def parse_link(link: str) -> tuple[str, str]:
    """``dedloc://add?url=...&key=...`` -> (catalog URL, base64 key); raise CatalogError if bad."""
    try:
        parts = urlsplit(link.strip())
    except ValueError:  # a malformed host ("dedloc://[add?...")
        raise catalog_error("bad_url", "Not an experiments link: it should start with dedloc://add?") from None
    if parts.scheme != SCHEME or (parts.netloc or parts.path.strip("/")) != "add":
        raise catalog_error("bad_url", "Not an experiments link: it should start with dedloc://add?")
    query = parse_qs(parts.query)
    url, key = (query.get(name, [""])[0].strip() for name in ("url", "key"))
    if not url or not key:
        raise catalog_error("bad_url", "The experiments link lacks its catalog URL or the organizer's key.")
    _raw_key(key)
    return _check_url(url), key


def add_link(url: str, key_b64: str) -> str:
    """The ``dedloc://add`` link of a source (what an organizer's page shows)."""
    from urllib.parse import urlencode

    return f"{SCHEME}://add?" + urlencode({"url": url, "key": key_b64})


def fetch_key(url: str, expected_fingerprint: str, timeout: float = 10.0) -> str:
    """The key published as ``catalog.pub`` next to the catalog at ``url``, checked against the
    fingerprint the person typed; returns its base64."""
    import urllib.error
    import urllib.request  # here: it loads ssl (a few MB), which the tray app never needs

    key_url = urljoin(_check_url(url), "catalog.pub")
    try:
        with urllib.request.urlopen(key_url, timeout=timeout) as response:  # http(s) checked
            text = response.read(MAX_KEY_BYTES).decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise catalog_error("unreachable", f"Cannot fetch the organizer's key from {key_url}: "
                                           f"{getattr(exc, 'reason', exc)}.") from None
    fields = next((line.split() for line in text.splitlines() if line.strip() and not line.startswith("#")), [])
    if len(fields) < 2 or fields[0] != "ed25519":
        raise catalog_error("bad_key", f"{key_url} holds no Ed25519 public key line.")
    wanted = expected_fingerprint.strip().lower().replace(":", "").replace(" ", "")
    if fingerprint(fields[1]) != wanted:
        raise catalog_error("untrusted_key", f"The key at {key_url} has fingerprint {fingerprint(fields[1])}, "
                                             f"not {wanted}: do not add this source.")
    return fields[1]


def builtin_source() -> Source | None:
    """The project's own source (its URL set at build time), or None when the build set none."""
    try:
        data = json.loads(paths.resource("catalog", "project_source.json").read_text())
        key_line = paths.resource("trusted_keys", data["key_file"]).read_text()
        key = next(line.split()[1] for line in key_line.splitlines() if line.startswith("ed25519 "))
        return Source(url=data["url"], key=key, name=data.get("name", ""), builtin=True) if data.get("url") else None
    except (OSError, KeyError, ValueError, StopIteration) as exc:  # a bad URL or key: ValueError
        logger.warning("No built-in catalog source: %s", exc)
        return None


class _File(msgspec.Struct):
    version: int = SOURCES_VERSION
    sources: list[Source] = []


class SourceList:
    """The sources a volunteer added (the built-in one is not stored), in ``path``."""

    def __init__(self, path: Path | None = None):
        self.path = path or paths.config_dir() / FILE_NAME
        self.warning: str | None = None
        self.added: list[Source] = self._load()

    def all(self) -> list[Source]:
        """The built-in source first, then the added ones."""
        builtin = builtin_source()
        return ([builtin] if builtin else []) + [s for s in self.added if not builtin or s.url != builtin.url]

    def add(self, url: str, key_b64: str, name: str = "") -> Source:
        # convert checks the lengths too (a name too long to load back would cost the whole file)
        source = msgspec.convert({"url": url, "key": key_b64, "name": name, "added_at": time.time()}, Source)
        self.added = [s for s in self.added if s.url != source.url] + [source]
        self._save()
        return source

    def remove(self, url_or_fingerprint: str) -> Source:
        match = [s for s in self.added if url_or_fingerprint in (s.url, s.fingerprint)]
        if not match:
            raise catalog_error("bad_url", f"No added source {url_or_fingerprint!r} (the built-in one stays).")
        self.added = [s for s in self.added if s not in match]
        self._save()
        return match[0]

    def _load(self) -> list[Source]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            self.warning = f"The catalog sources file could not be read ({exc.strerror})."
            return []
        try:
            return msgspec.json.decode(raw, type=_File).sources
        except (msgspec.DecodeError, RecursionError) as exc:
            backup = self.path.with_name(f"{self.path.name}.broken-{time.strftime('%Y%m%d-%H%M%S')}")
            try:
                self.path.replace(backup)
            except OSError:
                pass
            why = describe(exc, "file") if isinstance(exc, msgspec.ValidationError) else "not JSON"
            self.warning = (f"The catalog sources file was unreadable ({why}) and was kept "
                            f"as {backup.name}; only the built-in source is in use.")
            logger.warning(self.warning)
            return []

    def _save(self) -> None:
        data = msgspec.json.format(msgspec.json.encode(_File(sources=self.added)), indent=2).decode()
        paths.atomic_write(self.path, (data + "\n").encode())


def refresh_source(source: Source, timeout: float = 10.0) -> LoadResult:
    """Fetch ``source``'s catalog and verify it with its pinned key only; on any error its last good
    copy stays (there is no shipped copy of an added source)."""
    store = CatalogStore(paths.data_dir() / "catalog" / "sources" / f"{source.ident}.json", shipped=False)
    result = store.refresh(source.url, {source.fingerprint: source.public_key()}, timeout=timeout)
    if result.error is not None and result.error.code == "untrusted_key":
        kept = " Its last good copy stays." if result.catalog else ""
        error = catalog_error("untrusted_key", f"The catalog at {source.url} is signed by another key than the one "
                                               f"you trusted for it ({source.fingerprint}), so it was refused.{kept}")
        return LoadResult(result.catalog, error, result.source, result.expired)
    return result


def merge(main: LoadResult, main_state: SourceState, added: list[tuple[Source, LoadResult]]) -> LoadResult:
    """One list of experiments: the built-in source's, then each added source's (an id already
    listed is skipped, and said so); each experiment's origin and each source's state."""
    experiments = list(main.catalog.experiments) if main.catalog else []
    origins: dict[str, str | None] = {e.id: main_state.url for e in experiments}
    states = [main_state]
    for source, result in added:
        error = result.error
        count = 0
        for exp in result.catalog.experiments if result.catalog else []:
            if exp.id in origins:
                error = error or catalog_error("invalid", f"Experiment {exp.id!r} is already listed by another "
                                                          "source; this source's copy is not shown.")
                continue
            experiments.append(exp)
            origins[exp.id] = source.url
            count += 1
        states.append(SourceState(source.url, source.label(), source.fingerprint, False, count, error))
    base = main.catalog or next((r.catalog for _, r in added if r.catalog), None)
    catalog = msgspec.structs.replace(base, experiments=experiments) if base else None
    return LoadResult(catalog, main.error, main.source, main.expired, tuple(states), origins)


def inspect(url: str, key_b64: str, timeout: float = 10.0) -> Catalog:
    """The catalog at ``url``, verified with ``key_b64`` alone (before a person trusts the source)."""
    source = Source(url=_check_url(url), key=key_b64)
    return verify_catalog(fetch_catalog(source.url, timeout=timeout), {source.fingerprint: source.public_key()})


def organizer_of(catalog: Catalog) -> str:
    """Who publishes ``catalog``: its experiments' organizer (or their names, joined)."""
    names = list(dict.fromkeys(e.organizer for e in catalog.experiments))
    return ", ".join(names[:3]) or catalog.catalog_id
