"""Fetch and verify the catalog in a short-lived child process, for the tray app.

Signature checks need ``cryptography`` (about 12 MB resident once loaded), and the catalog is
untrusted input; the tray app keeps neither in its own long-lived process. The child runs
``CatalogStore.refresh`` (or ``load_default``) exactly as the app would, then prints one JSON
object: the verified catalog's payload, the error, the source. The app validates the payload
against the schema again (msgspec only) and gets the same ``LoadResult``. When the child fails, the
app keeps what it had and says so; it never checks signatures itself.

    python -m dedloc_core.catalog.child        (the frozen app: ``dedloc --catalog-child``)
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import asdict

import msgspec

from dedloc_core import joining
from dedloc_core.errors import CatalogError
from dedloc_core.workerproc import dedloc_command

from . import sources
from .model import Catalog, catalog_error, catalog_json
from .signing import load_trusted_keys
from .store import CatalogStore, LoadResult, SourceState

logger = logging.getLogger(__name__)
TIMEOUT = 60.0


def command() -> list[str]:
    if getattr(sys, "frozen", False):
        return dedloc_command("--catalog-child")  # the frozen executable re-run (dedloc_core.cli routes it)
    return [sys.executable, "-m", "dedloc_core.catalog.child"]


def load_here(url: str | None = None) -> LoadResult:
    """What the child does (in the child process: it loads ``cryptography``): the built-in source
    (or ``url`` / ``DEDLOC_CATALOG_URL`` in its place), then every source the volunteer added."""
    url = joining.catalog_url() if url is None else url
    store = CatalogStore()
    keys = load_trusted_keys(joining.trusted_key_paths())
    builtin = None if url else sources.builtin_source()
    if url:
        main = store.refresh(url, keys)
    elif builtin is not None:
        main = store.refresh(builtin.url, keys)
        if main.error is not None and main.error.code == "unreachable":  # offline: the shipped catalog, quietly
            main = LoadResult(main.catalog, None, main.source, main.expired)
    else:
        main = store.load_default(keys)
    organizer = main.catalog.experiments[0].organizer if main.catalog and main.catalog.experiments else ""
    state = SourceState(url or (builtin.url if builtin else None), builtin.name if builtin else organizer,
                        builtin.fingerprint if builtin else "", True,
                        len(main.catalog.experiments) if main.catalog else 0, main.error)
    added = sources.SourceList()
    return sources.merge(main, state, [(s, sources.refresh_source(s)) for s in added.added])


def _error(error: CatalogError | None) -> dict | None:
    return {"code": error.code, "title": error.title, "message": error.message} if error else None


def _unerror(data: dict | None) -> CatalogError | None:
    return CatalogError(data["message"], title=data["title"], code=data["code"]) if data else None


def encode(result: LoadResult) -> str:
    return json.dumps({
        "catalog": catalog_json(result.catalog) if result.catalog else None,
        "error": _error(result.error), "source": result.source, "expired": result.expired,
        "sources": [{**asdict(s), "error": _error(s.error)} for s in result.sources],
        "origins": dict(result.origins),
    })


def _catalog(text: str | None) -> Catalog | None:
    """The catalog the child sent, checked against the schema again (msgspec's errors are ValueErrors)."""
    return msgspec.json.decode(text, type=Catalog) if text is not None else None


def decode(text: str) -> LoadResult:
    data = json.loads(text)
    return LoadResult(
        catalog=_catalog(data["catalog"]),
        error=_unerror(data["error"]), source=data["source"], expired=bool(data["expired"]),
        sources=tuple(SourceState(**{**s, "error": _unerror(s["error"])}) for s in data.get("sources", [])),
        origins={str(k): (str(v) if v is not None else None) for k, v in data.get("origins", {}).items()})


def load(url: str | None = None, timeout: float = TIMEOUT, *, previous: LoadResult | None = None) -> LoadResult:
    """The catalog as ``load_here`` gives it, computed in a child process. If the child cannot run
    or answers nonsense, nothing is checked here (that would load ``cryptography`` into the tray):
    the result is ``previous`` (the last good catalog the caller has, or none) with a
    ``check_failed`` error that says what went wrong."""
    args = command() + ([url] if url is not None else [])
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=True)
        return decode(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError, TypeError, AttributeError,
            RecursionError) as exc:  # RecursionError: json.loads of a very deeply nested answer
        stderr = (getattr(exc, "stderr", "") or "").strip()
        logger.warning("The catalog child failed (%s) %s", exc, stderr[-500:])
        why = stderr.splitlines()[-1] if stderr else str(exc)
        kept = "showing the catalog loaded before" if previous and previous.catalog else "no catalog to show yet"
        error = catalog_error("check_failed", f"The catalog could not be checked ({why[:300]}); {kept}. "
                                              "It is tried again at the next refresh.")
        if previous is None:
            return LoadResult(None, error, "none", False)
        return LoadResult(previous.catalog, error, previous.source, previous.expired)


def inspect(url: str, key_b64: str, timeout: float = TIMEOUT) -> tuple[Catalog | None, CatalogError | None]:
    """``sources.inspect`` in a child process: the catalog a new source would give, or why not."""
    try:
        out = subprocess.run(command() + ["--inspect", url, key_b64], capture_output=True, text=True,
                             timeout=timeout, check=True)
        data = json.loads(out.stdout.strip().splitlines()[-1])
        catalog = _catalog(data["catalog"])
        return catalog, _unerror(data["error"])
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError, TypeError, AttributeError,
            RecursionError) as exc:  # RecursionError: json.loads of a very deeply nested answer
        logger.warning("The catalog child failed to inspect %s: %s", url, exc)
        return None, catalog_error("check_failed", f"The catalog could not be checked ({exc}).")


def _inspect_here(url: str, key_b64: str) -> str:
    try:
        catalog = sources.inspect(url, key_b64)
    except CatalogError as exc:
        return json.dumps({"catalog": None, "error": _error(exc)})
    return json.dumps({"catalog": catalog_json(catalog), "error": None})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if argv[:1] == ["--inspect"] and len(argv) == 3:
        print(_inspect_here(argv[1], argv[2]), flush=True)
        return 0
    print(encode(load_here(argv[0] if argv else None)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
