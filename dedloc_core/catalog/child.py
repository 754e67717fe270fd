"""Fetch and verify the catalog in a short-lived child process, for the tray app.

Signature checks need ``cryptography`` (about 12 MB resident once loaded), and the catalog is
untrusted input; the tray app keeps neither in its own long-lived process. The child runs
``CatalogStore.refresh`` (or ``load_default``) exactly as the app would, then prints one JSON
object: the verified catalog's payload, the error, the source. The app validates the payload
against the schema again (pydantic only) and gets the same ``LoadResult``.

    python -m dedloc_core.catalog.child        (the frozen app: ``dedloc --catalog-child``)
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from dedloc_core import joining
from dedloc_core.errors import CatalogError
from dedloc_core.workerproc import dedloc_command

from .model import Catalog
from .signing import load_trusted_keys
from .store import CatalogStore, LoadResult

logger = logging.getLogger(__name__)
TIMEOUT = 60.0


def command() -> list[str]:
    if getattr(sys, "frozen", False):
        return dedloc_command("--catalog-child")  # the frozen executable re-run (dedloc_core.cli routes it)
    return [sys.executable, "-m", "dedloc_core.catalog.child"]


def load_here(url: str | None = None) -> LoadResult:
    """What the child does (also the fallback when no child can run)."""
    url = joining.catalog_url() if url is None else url
    store = CatalogStore()
    keys = load_trusted_keys(joining.trusted_key_paths())
    return store.refresh(url, keys) if url else store.load_default(keys)


def encode(result: LoadResult) -> str:
    error = result.error
    return json.dumps({
        "catalog": result.catalog.model_dump_json() if result.catalog else None,
        "error": {"code": error.code, "title": error.title, "message": error.message} if error else None,
        "source": result.source, "expired": result.expired,
    })


def decode(text: str) -> LoadResult:
    data = json.loads(text)
    error = data["error"]
    return LoadResult(
        catalog=Catalog.model_validate_json(data["catalog"]) if data["catalog"] is not None else None,
        error=CatalogError(error["message"], title=error["title"], code=error["code"]) if error else None,
        source=data["source"], expired=bool(data["expired"]))


def load(url: str | None = None, timeout: float = TIMEOUT, *, fallback: bool = True) -> LoadResult:
    """The catalog as ``load_here`` gives it, computed in a child process. If the child cannot run
    or answers nonsense, the work is done here instead (and logged): the catalog is never lost.
    With ``fallback=False`` that failure raises instead."""
    args = command() + ([url] if url is not None else [])
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=True)
        return decode(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError, TypeError) as exc:
        if not fallback:
            raise
        stderr = getattr(exc, "stderr", "") or ""
        logger.warning("The catalog child failed (%s) %s; checking the catalog in this process",
                       exc, stderr[-500:])
        return load_here(url)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    print(encode(load_here(argv[0] if argv else None)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
