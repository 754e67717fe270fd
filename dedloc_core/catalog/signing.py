"""Organizer keys and the signed envelope: make and read keys, ``sign_catalog``, ``verify_catalog``.

``cryptography`` is imported inside the functions that use keys, so importing this module (or
``dedloc_core.catalog``) stays light; the tray app never calls them (``catalog.child`` does).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import reprlib
from collections.abc import Iterable, Mapping
from datetime import datetime
from importlib.abc import Traversable
from pathlib import Path
from typing import TYPE_CHECKING

from dedloc_core.paths import resource

from .model import ENVELOPE_FORMAT, MAX_CATALOG_BYTES, Catalog, catalog_error, catalog_json, validate_catalog

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

__all__ = [
    "generate_keypair", "key_id", "load_private_key", "load_trusted_keys", "parse_public_key", "public_key_line",
    "sign_catalog", "verify_catalog",
]


# ------------------------------------------------------------------------------------------ keys
def _passphrase_bytes(passphrase: str | bytes) -> bytes:
    return passphrase.encode() if isinstance(passphrase, str) else passphrase


def key_id(public_key: Ed25519PublicKey) -> str:
    """The first 16 hex digits of sha256 of the raw 32-byte public key."""
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def public_key_line(public_key: Ed25519PublicKey, comment: str = "") -> str:
    """``ed25519 <base64 raw key> [comment]``, the public key file format."""
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return " ".join(filter(None, ["ed25519", base64.b64encode(raw).decode(), comment.strip()]))


def parse_public_key(text: str) -> Ed25519PublicKey:
    """Read the first key line of a public key file (blank lines and ``#`` comments skipped)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    for line in text.splitlines():
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        try:
            if fields[0] != "ed25519" or len(fields) < 2:
                raise ValueError("expected 'ed25519 <base64 key> [comment]'")
            return Ed25519PublicKey.from_public_bytes(base64.b64decode(fields[1], validate=True))
        except (ValueError, binascii.Error) as exc:
            raise catalog_error("bad_key", f"Not an Ed25519 public key line: {exc}") from None
    raise catalog_error("bad_key", "The public key file holds no key.")


def generate_keypair(passphrase: str | bytes, comment: str = "") -> tuple[bytes, str]:
    """A new organizer key: (PKCS#8 PEM encrypted with ``passphrase``, public key line)."""
    if not passphrase:
        raise catalog_error("bad_key", "A passphrase is required: private keys are never stored in plain text.")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.BestAvailableEncryption(_passphrase_bytes(passphrase)))
    return pem, public_key_line(private.public_key(), comment)


def load_private_key(pem: bytes, passphrase: str | bytes) -> Ed25519PrivateKey:
    """Decrypt an organizer's private key; raise CatalogError(code="bad_key") if that fails."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        key = serialization.load_pem_private_key(pem, _passphrase_bytes(passphrase) or None)
    except (ValueError, TypeError) as exc:
        raise catalog_error("bad_key", f"Cannot read the private key (wrong passphrase?): {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise catalog_error("bad_key", "The private key is not an Ed25519 key.")
    return key


def load_trusted_keys(paths: Iterable[Path | str] | None = None) -> dict[str, Ed25519PublicKey]:
    """Trusted organizer keys by key id, from ``*.pub`` files (or folders of them); by default the
    keys shipped in ``resources/trusted_keys/``."""
    files: list[Path | Traversable] = []
    roots: Iterable[Path | Traversable] = ([resource("trusted_keys")] if paths is None
                                           else [Path(p) for p in paths])
    for root in roots:
        if root.is_dir():
            files.extend(sorted((f for f in root.iterdir() if f.name.endswith(".pub")), key=lambda f: f.name))
        elif paths is not None:
            files.append(root)
    keys: dict[str, Ed25519PublicKey] = {}
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise catalog_error("bad_key", f"Cannot read the public key file {file}: {exc}") from None
        key = parse_public_key(text)
        keys[key_id(key)] = key
    return keys


# ------------------------------------------------------------------------------ sign and verify
def sign_catalog(catalog: Catalog | str | bytes, private_key: Ed25519PrivateKey,
                 now: datetime | None = None) -> bytes:
    """The signed envelope of ``catalog`` (validated first; JSON text is signed exactly as given)."""
    payload = catalog_json(catalog, indent=1) if isinstance(catalog, Catalog) else (
        catalog.decode("utf-8") if isinstance(catalog, bytes) else catalog)
    checked = validate_catalog(payload)
    if checked.is_expired(now):
        raise catalog_error("expired", f"The catalog expired at {checked.expires_at.isoformat()}; "
                                "set a later expires_at before signing.")
    envelope = {
        "format": ENVELOPE_FORMAT,
        "key_id": key_id(private_key.public_key()),
        "signature": base64.b64encode(private_key.sign(payload.encode("utf-8"))).decode(),
        "payload": payload,
    }
    data = (json.dumps(envelope, indent=1) + "\n").encode("utf-8")
    if len(data) > MAX_CATALOG_BYTES:
        raise catalog_error("too_large", f"The signed catalog would be {len(data)} bytes; "
                                  f"the limit is {MAX_CATALOG_BYTES}.")
    return data


def verify_catalog(data: bytes | str, trusted_keys: Mapping[str, Ed25519PublicKey],
                   now: datetime | None = None, *, allow_expired: bool = False) -> Catalog:
    """Check a signed envelope against ``trusted_keys`` and return its catalog; raise CatalogError."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data  # lone surrogates: malformed
    if len(raw) > MAX_CATALOG_BYTES:
        raise catalog_error("too_large", f"The catalog is {len(raw)} bytes; the limit is {MAX_CATALOG_BYTES}.")
    try:
        envelope = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise catalog_error("malformed", "The catalog is not valid JSON.") from None
    except RecursionError:  # json's C parser gives up on very deep nesting ("[[[[..." a million times)
        raise catalog_error("malformed", "The catalog is not valid JSON (nested too deeply).") from None
    if not isinstance(envelope, dict):
        raise catalog_error("malformed", "The catalog is not a JSON object.")
    if "format" not in envelope:
        if "experiments" in envelope or "schema_version" in envelope:
            raise catalog_error("unsigned", "The catalog is a bare catalog without a signature envelope.")
        raise catalog_error("malformed", "The catalog is not a signed catalog envelope.")
    if envelope.get("format") != ENVELOPE_FORMAT:
        raise catalog_error("malformed", f"Unsupported catalog format {reprlib.repr(envelope.get('format'))}; "
                                  f"this app reads {ENVELOPE_FORMAT!r}.")  # reprlib: bounded, even for a huge value
    if not envelope.get("signature") or not envelope.get("key_id"):
        raise catalog_error("unsigned", "The catalog carries no signature.")
    extra = set(envelope) - {"format", "key_id", "signature", "payload"}
    kid, sig, payload = envelope["key_id"], envelope["signature"], envelope.get("payload")
    if extra or not isinstance(payload, str) or not isinstance(kid, str) or not isinstance(sig, str) \
            or not re.fullmatch(r"[0-9a-f]{16}", kid):
        raise catalog_error("malformed", "The catalog envelope has wrong or extra fields.")
    try:
        signature = base64.b64decode(sig, validate=True)
    except (binascii.Error, ValueError):
        raise catalog_error("malformed", "The catalog signature is not base64.") from None
    if len(signature) != 64:
        raise catalog_error("malformed", "The catalog signature is not an Ed25519 signature.")
    key = trusted_keys.get(kid)
    if key is None:
        raise catalog_error("untrusted_key", f"The catalog is signed by key {kid}, which this app does not trust.")
    from cryptography.exceptions import InvalidSignature

    try:
        key.verify(signature, payload.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in the JSON) has no UTF-8 bytes: never signed
        raise catalog_error("malformed", "The catalog payload is not valid Unicode text.") from None
    except InvalidSignature:
        raise catalog_error("tampered", "The catalog signature does not match its contents: "
                                 "it was altered after signing.") from None
    catalog = validate_catalog(payload)
    if not allow_expired and catalog.is_expired(now):
        raise catalog_error("expired", f"The catalog expired at {catalog.expires_at.isoformat()}.")
    return catalog

