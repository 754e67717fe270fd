"""Loading catalogs: ``fetch_catalog`` over http(s) and ``CatalogStore``, the last good copy on disk."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from importlib.abc import Traversable
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import urlsplit

from dedloc_core.errors import CatalogError
from dedloc_core.paths import atomic_write, data_dir, resource

from .model import MAX_CATALOG_BYTES, Catalog, catalog_error, validate_catalog
from .signing import load_trusted_keys, verify_catalog

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

__all__ = ["CatalogStore", "LoadResult", "SourceState", "fetch_catalog"]

logger = logging.getLogger(__name__)


# -------------------------------------------------------------------------------------- loading
def fetch_catalog(url: str, timeout: float = 10, max_bytes: int = MAX_CATALOG_BYTES) -> bytes:
    """Download a signed catalog over http(s); raise CatalogError (unreachable, too_large, bad_url)."""
    import urllib.error
    import urllib.request  # here: it loads ssl (a few MB), which the tray app never needs

    if urlsplit(url).scheme.lower() not in ("http", "https") or not urlsplit(url).hostname:
        raise catalog_error("bad_url", f"The catalog URL {url!r} must be an http or https URL.")

    class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
            if urlsplit(newurl).scheme.lower() not in ("http", "https"):
                raise catalog_error("bad_url", f"The catalog server redirected to {newurl!r}.")
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    opener = urllib.request.build_opener(_HttpOnlyRedirects)
    try:
        with opener.open(urllib.request.Request(url, headers={"Accept": "application/json"}),
                         timeout=timeout) as response:
            data = response.read(max_bytes + 1)
    except urllib.error.HTTPError as exc:
        raise catalog_error("unreachable", f"The catalog server answered {exc.code} {exc.reason} "
                                    f"for {url}.") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise catalog_error("unreachable", f"Cannot reach the catalog server at {url}: {reason}.") from None
    if len(data) > max_bytes:
        raise catalog_error("too_large", f"The catalog at {url} is larger than {max_bytes} bytes.")
    return data


@dataclass(frozen=True)
class LoadResult:
    """The catalog to show, why a newer one was refused (``error``), and where it came from."""

    catalog: Catalog | None
    error: CatalogError | None = None
    source: Literal["new", "last_good", "default", "none"] = "new"
    expired: bool = False
    # With several catalog sources (``sources.load_all``): each source's state, and which source's
    # catalog URL each experiment came from (None: the catalog shipped with the app).
    sources: tuple[SourceState, ...] = ()
    origins: Mapping[str, str | None] = field(default_factory=dict)

    @property
    def from_last_good(self) -> bool:
        return self.source == "last_good"


@dataclass(frozen=True)
class SourceState:
    """One catalog source as last loaded: where, whose key, how many experiments, what went wrong."""

    url: str | None  # None: the catalog shipped with the app
    name: str
    fingerprint: str
    builtin: bool
    experiments: int
    error: CatalogError | None = None


class CatalogStore:
    """The last good signed catalog on disk (``path``), with the shipped catalog as fallback (none
    with ``shipped=False``: an added source has no shipped copy)."""

    def __init__(self, path: Path | None = None, *, default: Path | Traversable | None = None, shipped: bool = True):
        self.path = path if path is not None else data_dir() / "catalog" / "last_good.json"
        self.default = default if default is not None else resource("catalog", "default.json")
        self.shipped = shipped

    def accept(self, data: bytes, trusted_keys: Mapping[str, Ed25519PublicKey] | None = None,
               now: datetime | None = None) -> LoadResult:
        """Verify ``data``; keep it if good, else return the last good catalog with the error."""
        keys = load_trusted_keys() if trusted_keys is None else trusted_keys
        try:
            catalog = verify_catalog(data, keys, now)
            previous = self._last_good(keys, now)
            if previous and previous.catalog and previous.catalog.catalog_id == catalog.catalog_id \
                    and catalog.issued_at < previous.catalog.issued_at:
                raise catalog_error("outdated", f"The catalog was issued at {catalog.issued_at.isoformat()}, "
                                         "before the one already loaded; refusing to roll back.")
        except CatalogError as exc:
            logger.warning("Catalog rejected (%s): %s", exc.code, exc.message)
            fallback = self.load_default(keys, now)
            return LoadResult(fallback.catalog, exc, fallback.source, fallback.expired)
        atomic_write(self.path, data if isinstance(data, bytes) else data.encode("utf-8"))
        return LoadResult(catalog, None, "new", False)

    def refresh(self, url: str, trusted_keys: Mapping[str, Ed25519PublicKey] | None = None,
                now: datetime | None = None, timeout: float = 10) -> LoadResult:
        """Fetch the catalog at ``url`` and ``accept`` it; on network errors keep the last good."""
        try:
            data = fetch_catalog(url, timeout=timeout)
        except CatalogError as exc:
            fallback = self.load_default(trusted_keys, now)
            return LoadResult(fallback.catalog, exc, fallback.source, fallback.expired)
        return self.accept(data, trusted_keys, now)

    def load_default(self, trusted_keys: Mapping[str, Ed25519PublicKey] | None = None,
                     now: datetime | None = None) -> LoadResult:
        """The last good catalog or, without a usable one, the catalog shipped with the app."""
        keys = load_trusted_keys() if trusted_keys is None else trusted_keys
        if not self.shipped:
            return self._last_good(keys, now) or LoadResult(None, None, "none", False)
        return self._last_good(keys, now) or self._shipped(keys, now)

    def _last_good(self, keys: Mapping[str, Ed25519PublicKey], now: datetime | None) -> LoadResult | None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("Cannot read the last good catalog %s: %s", self.path, exc)
            return None
        try:
            catalog = verify_catalog(data, keys, allow_expired=True)
        except CatalogError as exc:
            logger.warning("Ignoring the last good catalog %s (%s): %s", self.path, exc.code, exc.message)
            return None
        expired = catalog.is_expired(now)
        return LoadResult(catalog, _expired_error(catalog) if expired else None, "last_good", expired)

    def _shipped(self, keys: Mapping[str, Ed25519PublicKey], now: datetime | None) -> LoadResult:
        """The shipped default: a signed envelope is verified; a bare catalog is trusted like the
        app's own code (it ships inside it) and only checked against the schema."""
        try:
            data = self.default.read_bytes()
            try:
                is_envelope = "format" in json.loads(data)
            except (ValueError, TypeError):
                is_envelope = False
            catalog = (verify_catalog(data, keys, allow_expired=True) if is_envelope
                       else validate_catalog(data))
        except (OSError, CatalogError) as exc:
            error = (exc if isinstance(exc, CatalogError)
                     else catalog_error("malformed", f"No default catalog: {exc}"))
            logger.error("The shipped default catalog is unusable: %s", error.message)
            return LoadResult(None, error, "none", False)
        expired = catalog.is_expired(now)
        return LoadResult(catalog, _expired_error(catalog) if expired else None, "default", expired)


def _expired_error(catalog: Catalog) -> CatalogError:
    return catalog_error("expired", f"The catalog expired at {catalog.expires_at.isoformat()}; "
                             "it is shown until a newer one can be loaded.")
