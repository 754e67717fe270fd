"""The catalog's schema: experiments, their recipes, data and hardware minimums; ``validate_catalog``.

Every rejection is a ``CatalogError`` whose ``code`` says why (the codes are listed in
``dedloc_core.catalog``). Pydantic only: no ``cryptography``, no torch.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, Any, Literal
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

from dedloc_core.errors import CatalogError, RecipeError

from .recipes import RECIPE_NAMES, validate_params
from .shards import Shard

__all__ = [
    "ENVELOPE_FORMAT", "MAX_CATALOG_BYTES", "PASSPHRASE_ENV", "Catalog", "DataSource", "DilocoParams",
    "Experiment", "HardwareMinimums", "catalog_error", "validate_catalog",
]

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
    "check_failed": "Catalog not checked",
}
# When one catalog has several problems, the most specific code wins.
_PRIORITY = ("unsafe_name", "unknown_recipe", "invalid_value", "invalid")
_BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number",
                 "multiple_of", "invalid_value"}


def catalog_error(code: str, message: str) -> CatalogError:
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
    # invite-only (needs_token): the issuer's Ed25519 public key (base64 of 32 raw bytes) that signs the
    # volunteers' tokens, and the backbone's HTTP root where codes are redeemed (``organizer/invites.py``)
    invite_key: str | None = Field(default=None, max_length=64)
    invite_url: str | None = Field(default=None, max_length=2048)
    status: Literal["active", "paused", "finished", "upcoming"]
    expires_at: AwareDatetime | None = None
    mode: Literal["sync", "diloco"] = "sync"
    # sync mode: average a step's gradients in the background while the next step accumulates, and
    # apply them one step late (DeDLOC's delayed updates); false: every step waits for its round
    overlap: bool = True
    # sync mode: global steps between parameter averaging rounds (gradients are averaged every step;
    # this bounds the drift that lossy gradients and failed rounds leave between peers)
    average_state_every: int = Field(1, ge=1, le=1000)
    diloco: DilocoParams = Field(default_factory=DilocoParams)
    # How each peer combines the parts it reduces (engine/robust.py): a NaN/inf part is dropped either way
    aggregation: Literal["mean", "centered_clip"] = "mean"
    clip_radius: float = Field(1.0, gt=0.0, le=100.0)  # tau, in median distances from the median
    clip_iterations: int = Field(3, ge=1, le=20)

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
        if (self.invite_key or self.invite_url) and not self.needs_token:
            raise _fail("invalid", "invite_key and invite_url belong to an invite-only experiment (needs_token)")
        if self.invite_key is not None:
            try:
                raw = base64.b64decode(self.invite_key, validate=True)
            except ValueError:
                raw = b""
            if len(raw) != 32:
                raise _fail("invalid", "invite_key must be the base64 of a 32-byte Ed25519 public key")
        if self.invite_url is not None:
            _check_url(self.invite_url, "invite_url", relative_ok=False)
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
        try:
            text = json.dumps(text)
        except (RecursionError, ValueError, TypeError):  # nested too deeply, a huge int, not JSON values
            raise catalog_error("malformed", "The catalog is not JSON data.") from None
    try:
        return Catalog.model_validate_json(text)
    except ValidationError as exc:
        errors = exc.errors()
        if any(e["type"] in ("json_invalid", "json_type") or (e["loc"] == () and e["type"] in ("model_type",
               "string_unicode")) for e in errors):
            raise catalog_error("malformed", "The catalog is not a JSON object.") from None
        codes = {e["type"] if e["type"] in _PRIORITY else
                 "invalid_value" if e["type"] in _BOUND_ERRORS else "invalid" for e in errors}
        code = next(c for c in _PRIORITY if c in codes)
        lines = [f"{_loc(e['loc'])}: {e['msg']}" for e in errors]
        more = f" (and {len(lines) - 5} more)" if len(lines) > 5 else ""
        raise catalog_error(code, "; ".join(lines[:5]) + more) from None
