"""The signed experiment catalog: schema, Ed25519 signatures, verification and the last good copy.

**The catalog never carries code.** An experiment names one of the recipes that ship with the app
(``dedloc_core.recipes.RECIPE_NAMES``) and gives it parameters, which are validated against that
recipe's schema; nothing in a catalog is ever imported, evaluated or executed.

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
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import re
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.abc import Traversable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import unquote, urlsplit

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .errors import CatalogError, RecipeError
from .paths import atomic_write, data_dir, resource
from .recipes import RECIPE_NAMES, validate_params
from .shards import Shard

if TYPE_CHECKING:  # cryptography is imported where keys are used: the tray app reads catalogs without it
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

__all__ = [
    "ENVELOPE_FORMAT", "MAX_CATALOG_BYTES", "PASSPHRASE_ENV", "Catalog", "CatalogStore", "DataSource",
    "DilocoParams", "Experiment", "HardwareMinimums", "LoadResult", "fetch_catalog", "generate_keypair", "key_id",
    "load_private_key", "load_trusted_keys", "parse_public_key", "public_key_line", "sign_catalog",
    "validate_catalog", "verify_catalog",
]

logger = logging.getLogger(__name__)

ENVELOPE_FORMAT = "dedloc-catalog/1"
MAX_CATALOG_BYTES = 4 * 2**20
PASSPHRASE_ENV = "DEDLOC_CATALOG_PASSPHRASE"

_TITLES = {
    "malformed": "Catalog unreadable",
    "unsigned": "Catalog not signed",
    "untrusted_key": "Catalog signed by an unknown key",
    "tampered": "Catalog signature does not match",
    "invalid": "Catalog invalid",
    "unknown_recipe": "Catalog needs a newer app",
    "invalid_value": "Catalog has impossible values",
    "unsafe_name": "Catalog has unsafe names",
    "expired": "Catalog expired",
    "too_large": "Catalog too large",
    "outdated": "Catalog older than the one loaded",
    "unreachable": "Catalog server unreachable",
    "bad_url": "Bad catalog URL",
    "bad_key": "Bad key",
}
# When one catalog has several problems, the most specific code wins.
_PRIORITY = ("unsafe_name", "unknown_recipe", "invalid_value", "invalid")
_BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number",
                 "multiple_of", "invalid_value"}


def _error(code: str, message: str) -> CatalogError:
    return CatalogError(message, title=_TITLES[code], code=code)


def _fail(kind: str, message: str) -> PydanticCustomError:
    """A validation error of ``kind`` (one of the codes above), with ``message`` taken verbatim."""
    return PydanticCustomError(kind, "{reason}", {"reason": message})


def _short(value: str) -> str:
    return repr(value if len(value) <= 80 else value[:77] + "...")


# ---------------------------------------------------------------------------------------- names
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SLUG = re.compile(r"^[a-z0-9][a-z0-9-]{1,62}$")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_MULTIADDR = re.compile(r"^(/[A-Za-z0-9._:+=-]+)+$")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_REL_URL = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+-]*(/[A-Za-z0-9_][A-Za-z0-9._+-]*)*$")


def _unquote_fully(text: str) -> str:
    for _ in range(5):
        decoded = unquote(text)
        if decoded == text:
            break
        text = decoded
    return text


def _name_validator(pattern: re.Pattern[str], what: str) -> AfterValidator:
    def check(value: str) -> str:
        if (any(bad in value for bad in ("..", "/", "\\", ":", "%")) or _CONTROL.search(value)
                or value.startswith(("~", "."))):
            raise _fail("unsafe_name", f"{what} {_short(value)} looks like a file path; "
                                       "it must be a plain name")
        if not pattern.fullmatch(value):
            raise _fail("invalid", f"{what} {_short(value)} must match {pattern.pattern}")
        return value
    return AfterValidator(check)


def _check_url(url: str, what: str, *, relative_ok: bool) -> str:
    """Accept absolute http(s) URLs and, if ``relative_ok``, plain relative paths; nothing else."""
    decoded = _unquote_fully(url)
    if _CONTROL.search(decoded) or "\\" in decoded or " " in url:
        raise _fail("unsafe_name", f"{what} {_short(url)} contains spaces, control characters "
                                   "or backslashes")
    scheme = _SCHEME.match(url)
    if scheme:
        if scheme.group(1).lower() not in ("http", "https"):
            raise _fail("unsafe_name", f"{what} {_short(url)} uses the {scheme.group(1)}: scheme; "
                                       "only http and https are allowed")
        if ".." in decoded:
            raise _fail("unsafe_name", f"{what} {_short(url)} contains '..'")
        if not urlsplit(url).hostname:
            raise _fail("invalid", f"{what} {_short(url)} has no host")
        return url
    if not relative_ok:
        if url.startswith(("/", "~")):
            raise _fail("unsafe_name", f"{what} {_short(url)} is a file path; use an http(s) URL")
        raise _fail("invalid", f"{what} {_short(url)} must be an absolute http or https URL")
    if url.startswith(("/", "~")):
        raise _fail("unsafe_name", f"{what} {_short(url)} is an absolute path; "
                                   "relative shard URLs must not start with '/' or '~'")
    if "%" in url or ".." in url:
        raise _fail("unsafe_name", f"{what} {_short(url)} contains '..' or percent-encoding")
    if not _REL_URL.fullmatch(url):
        raise _fail("invalid", f"{what} {_short(url)} must be a plain relative path "
                               "(letters, digits, '.', '_', '+', '-' and '/')")
    return url


def _check_multiaddr(value: str) -> str:
    if not _MULTIADDR.fullmatch(value):
        raise _fail("invalid", f"initial peer {_short(value)} is not a multiaddr "
                               "like /ip4/1.2.3.4/tcp/31337/p2p/Qm...")
    return value


def _check_text(value: str) -> str:
    if _CONTROL.search(value.replace("\n", "").replace("\t", "")):
        raise _fail("invalid", "text must not contain control characters")
    return value


def _check_recipe(value: str) -> str:
    if value not in RECIPE_NAMES:
        raise _fail("unknown_recipe", f"unknown recipe {_short(value)}; this app knows "
                                      f"{', '.join(sorted(RECIPE_NAMES))} (a newer app may know more)")
    return value


Slug = Annotated[str, _name_validator(_SLUG, "id")]
RunId = Annotated[str, _name_validator(_RUN_ID, "run_id")]
Multiaddr = Annotated[str, Field(max_length=512), AfterValidator(_check_multiaddr)]
Line = Annotated[str, Field(min_length=1, max_length=200), AfterValidator(_check_text)]


# --------------------------------------------------------------------------------------- schema
class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class HardwareMinimums(_Model):
    """What a volunteer's machine needs to join."""

    ram_gb: float = Field(ge=0, le=4096)
    cpu_cores: int = Field(ge=1, le=1024)
    disk_gb: float = Field(ge=0, le=100_000)
    gpu_required: bool
    gpu_memory_gb: float | None = Field(default=None, gt=0, le=1024)


class DataSource(_Model):
    """Where the training data comes from. Relative shard URLs resolve against ``base_url`` or,
    when it is None, against the URL the catalog was fetched from."""

    base_url: str | None = Field(default=None, max_length=2048)
    shards: list[Shard] = Field(min_length=1, max_length=10_000)

    @field_validator("base_url")
    @classmethod
    def _safe_base(cls, value: str | None) -> str | None:
        if value is None:
            return None
        _check_url(value, "base_url", relative_ok=False)
        return value if value.endswith("/") else value + "/"

    @field_validator("shards")
    @classmethod
    def _safe_shards(cls, shards: list[Shard]) -> list[Shard]:
        for i, shard in enumerate(shards):
            _check_url(shard.url, f"shards[{i}].url", relative_ok=True)
        return shards


class DilocoParams(_Model):
    """DiLoCo training (``mode: diloco``): ``inner_steps`` local optimizer steps (H), then the swarm
    averages the deltas from the last synced model, compressed by ``compression``, and an outer
    SGD (``outer_lr``, Nesterov momentum ``outer_momentum``, none if 0) applies the average.

    The defaults (lr 1.0, no momentum: the outer model becomes the average of the peers' models)
    did best for tiny-lm over 3 and 10 rounds (bench/diloco_runs.md: 10 rounds, eval loss 1.57
    against 1.94 with the DiLoCo paper's 0.7 / Nesterov 0.9, which it tuned over hundreds of
    rounds); an experiment meant to run that long may set the paper's values."""

    inner_steps: int = Field(100, ge=1, le=100_000)
    outer_lr: float = Field(1.0, gt=0, le=10)
    outer_momentum: float = Field(0.0, ge=0, lt=1)
    compression: Literal["none", "fp16", "8bit"] = "8bit"
    # Every this many rounds each peer but the round's leader copies the leader's outer model
    # (0: never). Lossy deltas (8-bit) give each peer a slightly different average every round, so
    # the peers' outer models drift apart; this bounds the drift at the cost of one state download.
    resync_every: int = Field(10, ge=0, le=100_000)


class Experiment(_Model):
    """One training run volunteers can join. ``mode`` is ``sync`` (DeDLOC: every global step
    averages gradients to reach ``target_batch_size``) or ``diloco`` (see ``DilocoParams``)."""

    id: Slug
    title: Line
    description: Annotated[str, Field(max_length=10_000), AfterValidator(_check_text)] = ""
    organizer: Line
    recipe: Annotated[str, AfterValidator(_check_recipe)]
    recipe_params: dict[str, Any] = Field(default_factory=dict)
    run_id: RunId
    initial_peers: list[Multiaddr] = Field(default_factory=list, max_length=64)
    target_batch_size: int = Field(ge=1, le=10_000_000)
    batch_size_per_step: int = Field(ge=1, le=65_536)
    matchmaking_time: float = Field(ge=0.1, le=600)
    averaging_timeout: float = Field(ge=1, le=3600)
    hardware: HardwareMinimums
    data: DataSource
    needs_token: bool = False
    status: Literal["active", "paused", "finished", "upcoming"]
    expires_at: AwareDatetime | None = None
    mode: Literal["sync", "diloco"] = "sync"
    diloco: DilocoParams = Field(default_factory=DilocoParams)

    @model_validator(mode="after")
    def _consistent(self) -> Experiment:
        try:
            validate_params(self.recipe, self.recipe_params)
        except RecipeError as exc:
            cause = exc.__cause__
            if isinstance(cause, ValidationError):
                kinds = {e["type"] for e in cause.errors()}
                details = "; ".join(f"recipe_params.{_loc(e['loc'])}: {e['msg']}" for e in cause.errors())
                raise _fail("invalid_value" if kinds <= _BOUND_ERRORS else "invalid", details) from None
            raise _fail("invalid", f"recipe_params: {exc.message}") from None
        if self.batch_size_per_step > self.target_batch_size:
            raise _fail("invalid_value", f"batch_size_per_step ({self.batch_size_per_step}) exceeds "
                                         f"target_batch_size ({self.target_batch_size})")
        return self


class Catalog(_Model):
    """A list of experiments, issued and signed by an organizer, valid until ``expires_at``."""

    schema_version: Literal[1]
    catalog_id: Slug
    issued_at: AwareDatetime
    expires_at: AwareDatetime
    experiments: list[Experiment] = Field(default_factory=list, max_length=1000)

    @model_validator(mode="after")
    def _consistent(self) -> Catalog:
        if self.expires_at <= self.issued_at:
            raise _fail("invalid", "expires_at must be later than issued_at")
        seen: set[str] = set()
        for exp in self.experiments:
            if exp.id in seen:
                raise _fail("invalid", f"duplicate experiment id {exp.id!r}")
            seen.add(exp.id)
        return self

    def get(self, exp_id: str) -> Experiment | None:
        """The experiment with id ``exp_id``, or None."""
        return next((exp for exp in self.experiments if exp.id == exp_id), None)

    def is_expired(self, now: datetime | None = None) -> bool:
        """Whether ``expires_at`` has passed at ``now`` (default: the current time)."""
        return self.expires_at <= (now or datetime.now(UTC))


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "catalog"


def validate_catalog(text: str | bytes | Mapping[str, Any] | Catalog) -> Catalog:
    """Check a catalog (JSON text, dict or model) against the schema; raise CatalogError if bad."""
    if isinstance(text, Catalog):
        text = text.model_dump_json()
    elif isinstance(text, Mapping):
        text = json.dumps(text)
    try:
        return Catalog.model_validate_json(text)
    except ValidationError as exc:
        errors = exc.errors()
        if any(e["type"] in ("json_invalid", "json_type") or (e["loc"] == () and e["type"] == "model_type")
               for e in errors):
            raise _error("malformed", "The catalog is not a JSON object.") from None
        codes = {e["type"] if e["type"] in _PRIORITY else
                 "invalid_value" if e["type"] in _BOUND_ERRORS else "invalid" for e in errors}
        code = next(c for c in _PRIORITY if c in codes)
        lines = [f"{_loc(e['loc'])}: {e['msg']}" for e in errors]
        more = f" (and {len(lines) - 5} more)" if len(lines) > 5 else ""
        raise _error(code, "; ".join(lines[:5]) + more) from None


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
            raise _error("bad_key", f"Not an Ed25519 public key line: {exc}") from None
    raise _error("bad_key", "The public key file holds no key.")


def generate_keypair(passphrase: str | bytes, comment: str = "") -> tuple[bytes, str]:
    """A new organizer key: (PKCS#8 PEM encrypted with ``passphrase``, public key line)."""
    if not passphrase:
        raise _error("bad_key", "A passphrase is required: private keys are never stored in plain text.")
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
        raise _error("bad_key", f"Cannot read the private key (wrong passphrase?): {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise _error("bad_key", "The private key is not an Ed25519 key.")
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
            raise _error("bad_key", f"Cannot read the public key file {file}: {exc}") from None
        key = parse_public_key(text)
        keys[key_id(key)] = key
    return keys


# ------------------------------------------------------------------------------ sign and verify
def sign_catalog(catalog: Catalog | str | bytes, private_key: Ed25519PrivateKey,
                 now: datetime | None = None) -> bytes:
    """The signed envelope of ``catalog`` (validated first; JSON text is signed exactly as given)."""
    payload = catalog.model_dump_json(indent=1) if isinstance(catalog, Catalog) else (
        catalog.decode("utf-8") if isinstance(catalog, bytes) else catalog)
    checked = validate_catalog(payload)
    if checked.is_expired(now):
        raise _error("expired", f"The catalog expired at {checked.expires_at.isoformat()}; "
                                "set a later expires_at before signing.")
    envelope = {
        "format": ENVELOPE_FORMAT,
        "key_id": key_id(private_key.public_key()),
        "signature": base64.b64encode(private_key.sign(payload.encode("utf-8"))).decode(),
        "payload": payload,
    }
    data = (json.dumps(envelope, indent=1) + "\n").encode("utf-8")
    if len(data) > MAX_CATALOG_BYTES:
        raise _error("too_large", f"The signed catalog would be {len(data)} bytes; "
                                  f"the limit is {MAX_CATALOG_BYTES}.")
    return data


def verify_catalog(data: bytes | str, trusted_keys: Mapping[str, Ed25519PublicKey],
                   now: datetime | None = None, *, allow_expired: bool = False) -> Catalog:
    """Check a signed envelope against ``trusted_keys`` and return its catalog; raise CatalogError."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if len(raw) > MAX_CATALOG_BYTES:
        raise _error("too_large", f"The catalog is {len(raw)} bytes; the limit is {MAX_CATALOG_BYTES}.")
    try:
        envelope = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _error("malformed", "The catalog is not valid JSON.") from None
    if not isinstance(envelope, dict):
        raise _error("malformed", "The catalog is not a JSON object.")
    if "format" not in envelope:
        if "experiments" in envelope or "schema_version" in envelope:
            raise _error("unsigned", "The catalog is a bare catalog without a signature envelope.")
        raise _error("malformed", "The catalog is not a signed catalog envelope.")
    if envelope.get("format") != ENVELOPE_FORMAT:
        raise _error("malformed", f"Unsupported catalog format {envelope.get('format')!r}; "
                                  f"this app reads {ENVELOPE_FORMAT!r}.")
    if not envelope.get("signature") or not envelope.get("key_id"):
        raise _error("unsigned", "The catalog carries no signature.")
    extra = set(envelope) - {"format", "key_id", "signature", "payload"}
    kid, sig, payload = envelope["key_id"], envelope["signature"], envelope.get("payload")
    if extra or not isinstance(payload, str) or not isinstance(kid, str) or not isinstance(sig, str) \
            or not re.fullmatch(r"[0-9a-f]{16}", kid):
        raise _error("malformed", "The catalog envelope has wrong or extra fields.")
    try:
        signature = base64.b64decode(sig, validate=True)
    except (binascii.Error, ValueError):
        raise _error("malformed", "The catalog signature is not base64.") from None
    if len(signature) != 64:
        raise _error("malformed", "The catalog signature is not an Ed25519 signature.")
    key = trusted_keys.get(kid)
    if key is None:
        raise _error("untrusted_key", f"The catalog is signed by key {kid}, which this app does not trust.")
    from cryptography.exceptions import InvalidSignature

    try:
        key.verify(signature, payload.encode("utf-8"))
    except InvalidSignature:
        raise _error("tampered", "The catalog signature does not match its contents: "
                                 "it was altered after signing.") from None
    catalog = validate_catalog(payload)
    if not allow_expired and catalog.is_expired(now):
        raise _error("expired", f"The catalog expired at {catalog.expires_at.isoformat()}.")
    return catalog


# -------------------------------------------------------------------------------------- loading
def fetch_catalog(url: str, timeout: float = 10, max_bytes: int = MAX_CATALOG_BYTES) -> bytes:
    """Download a signed catalog over http(s); raise CatalogError (unreachable, too_large, bad_url)."""
    if urlsplit(url).scheme.lower() not in ("http", "https") or not urlsplit(url).hostname:
        raise _error("bad_url", f"The catalog URL {url!r} must be an http or https URL.")

    class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
            if urlsplit(newurl).scheme.lower() not in ("http", "https"):
                raise _error("bad_url", f"The catalog server redirected to {newurl!r}.")
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    opener = urllib.request.build_opener(_HttpOnlyRedirects)
    try:
        with opener.open(urllib.request.Request(url, headers={"Accept": "application/json"}),
                         timeout=timeout) as response:
            data = response.read(max_bytes + 1)
    except urllib.error.HTTPError as exc:
        raise _error("unreachable", f"The catalog server answered {exc.code} {exc.reason} "
                                    f"for {url}.") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise _error("unreachable", f"Cannot reach the catalog server at {url}: {reason}.") from None
    if len(data) > max_bytes:
        raise _error("too_large", f"The catalog at {url} is larger than {max_bytes} bytes.")
    return data


@dataclass(frozen=True)
class LoadResult:
    """The catalog to show, why a newer one was refused (``error``), and where it came from."""

    catalog: Catalog | None
    error: CatalogError | None = None
    source: Literal["new", "last_good", "default", "none"] = "new"
    expired: bool = False

    @property
    def from_last_good(self) -> bool:
        return self.source == "last_good"


class CatalogStore:
    """The last good signed catalog on disk (``path``), with the shipped catalog as fallback."""

    def __init__(self, path: Path | None = None, *, default: Path | Traversable | None = None):
        self.path = path if path is not None else data_dir() / "catalog" / "last_good.json"
        self.default = default if default is not None else resource("catalog", "default.json")

    def accept(self, data: bytes, trusted_keys: Mapping[str, Ed25519PublicKey] | None = None,
               now: datetime | None = None) -> LoadResult:
        """Verify ``data``; keep it if good, else return the last good catalog with the error."""
        keys = load_trusted_keys() if trusted_keys is None else trusted_keys
        try:
            catalog = verify_catalog(data, keys, now)
            previous = self._last_good(keys, now)
            if previous and previous.catalog and previous.catalog.catalog_id == catalog.catalog_id \
                    and catalog.issued_at < previous.catalog.issued_at:
                raise _error("outdated", f"The catalog was issued at {catalog.issued_at.isoformat()}, "
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
                     else _error("malformed", f"No default catalog: {exc}"))
            logger.error("The shipped default catalog is unusable: %s", error.message)
            return LoadResult(None, error, "none", False)
        expired = catalog.is_expired(now)
        return LoadResult(catalog, _expired_error(catalog) if expired else None, "default", expired)


def _expired_error(catalog: Catalog) -> CatalogError:
    return _error("expired", f"The catalog expired at {catalog.expires_at.isoformat()}; "
                             "it is shown until a newer one can be loaded.")
