"""The signed experiment catalog: schema, Ed25519 signatures, verification and the last good copy.

**The catalog never carries code.** An experiment names one of the recipes that ship with the app
(``recipes.RECIPE_NAMES``) and gives it parameters, which are validated against that
recipe's schema (a declared transformers model's family and config included); nothing in a
catalog is ever imported, evaluated or executed.

A signed catalog is a JSON envelope around the catalog text::

    {"format": "dedloc-catalog/1",
     "key_id": "<first 16 hex digits of sha256(raw 32-byte Ed25519 public key)>",
     "signature": "<base64 Ed25519 signature over the UTF-8 bytes of payload>",
     "payload": "<the catalog JSON, as a string>"}

Signing the exact payload string avoids any JSON canonicalization. Public keys are one line,
``ed25519 <base64 raw key> [comment]``; private keys are PKCS#8 PEM encrypted with a passphrase.

Every rejection is a ``CatalogError`` whose ``code`` says why: ``malformed``, ``unsigned``,
``untrusted_key``, ``tampered``, ``invalid``, ``unknown_recipe``, ``invalid_value``, ``unsafe_name``,
``expired``, ``too_large``, ``outdated`` (older than the last good one), ``unreachable``,
``bad_url`` (catalog URL not http/https) and ``bad_key`` (unreadable key file or passphrase).

``CatalogStore`` keeps the last good envelope on disk. A rejected catalog never replaces it: the
store returns the last good one (signature re-checked) with the error. A last good catalog that
has expired since is still returned, flagged ``expired=True``, so the app can show it greyed out
instead of showing nothing; the app should not start new work from an expired catalog. Without a
usable last good copy the store falls back to the catalog shipped in ``resources/catalog/``.

The code is organized as follows:

- ``model``: the schema (experiments, data sources, hardware minimums; msgspec Structs),
  ``validate_catalog`` and ``catalog_json``.
- ``recipes``: the built-in recipes' names and parameter schemas (the engine builds the recipes).
- ``declared``: declared transformers models: families, config checks, exact sizes and ``fit``.
- ``shards``: the data shard model (URL, sha256, size) and ``resolve_url``.
- ``signing``: organizer keys (``cryptography``, imported only where keys are used), ``sign_catalog``,
  ``verify_catalog``.
- ``store``: ``fetch_catalog`` and ``CatalogStore`` (the last good copy).
- ``sources``: the catalog sources (a URL pinned to its organizer's key; ``dedloc://add`` links).
- ``child``: runs the store in a short-lived child process for the tray app.
- ``cli``: ``dedloc catalog keygen | sign | verify | show | add | list | remove``.

A light room: msgspec and the standard library (``urllib.request``, which loads ``ssl``, only inside
the functions that fetch); the tray app imports it. Never torch, hivemind or pydantic.
"""

from __future__ import annotations

from .model import (
    ENVELOPE_FORMAT,
    MAX_CATALOG_BYTES,
    PASSPHRASE_ENV,
    Catalog,
    DataSource,
    DilocoParams,
    Experiment,
    HardwareMinimums,
    catalog_json,
    validate_catalog,
)
from .signing import (
    generate_keypair,
    key_id,
    load_private_key,
    load_trusted_keys,
    parse_public_key,
    public_key_line,
    sign_catalog,
    verify_catalog,
)
from .store import CatalogStore, LoadResult, fetch_catalog

__all__ = [
    "ENVELOPE_FORMAT", "MAX_CATALOG_BYTES", "PASSPHRASE_ENV", "Catalog", "CatalogStore", "DataSource",
    "DilocoParams", "Experiment", "HardwareMinimums", "LoadResult", "catalog_json", "fetch_catalog",
    "generate_keypair", "key_id", "load_private_key", "load_trusted_keys", "parse_public_key", "public_key_line",
    "sign_catalog", "validate_catalog", "verify_catalog",
]
