"""The catalog's schema: experiments, their recipes, data and hardware minimums; ``validate_catalog``.

Every rejection is a ``CatalogError`` whose ``code`` says why (the codes are listed in
``dedloc_core.catalog``). The models are frozen msgspec Structs: types and ranges are checked when a
catalog is decoded (``validate_catalog``), the checks that need code in ``__post_init__``. msgspec
only: no ``cryptography``, no torch.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Annotated, Any, Literal
from urllib.parse import unquote, urlsplit

import msgspec
from msgspec import Meta

from dedloc_core import environ
from dedloc_core.errors import CatalogError, RecipeError
from dedloc_core.schema import problem

from .declared import check_fits, fit
from .recipes import DECLARED, RECIPE_NAMES, validate_params
from .shards import Shard

__all__ = [
    "ENVELOPE_FORMAT", "MAX_CATALOG_BYTES", "PASSPHRASE_ENV", "Catalog", "DataSource", "DilocoParams",
    "Experiment", "HardwareMinimums", "catalog_error", "catalog_json", "experiment_from", "validate_catalog",
]

ENVELOPE_FORMAT = "dedloc-catalog/1"
MAX_CATALOG_BYTES = 4 * 2**20
PASSPHRASE_ENV = environ.CATALOG_PASSPHRASE.name

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
# msgspec's reasons for a number out of its range (``invalid_value``; other wrong values are ``invalid``)
_BOUND = re.compile(r"^(Expected `(int|float)` (>=|<=|>|<|that's a multiple of) |(Integer value|Number) out of range)")


def catalog_error(code: str, message: str) -> CatalogError:
    return CatalogError(message, title=_TITLES[code], code=code)


class _Invalid(ValueError):
    """A check in ``__post_init__`` failed: ``kind`` is the code, ``field`` the field it is about
    (msgspec gives the path of the model; ``validate_catalog`` adds the field)."""

    def __init__(self, kind: str, field: str, message: str):
        super().__init__(message)
        self.kind, self.field, self.message = kind, field, message


def _fail(kind: str, field: str, message: str) -> _Invalid:
    return _Invalid(kind, field, message)


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


def _check_name(value: str, pattern: re.Pattern[str], field: str, what: str) -> None:
    if (any(bad in value for bad in ("..", "/", "\\", ":", "%")) or _CONTROL.search(value)
            or value.startswith(("~", "."))):
        raise _fail("unsafe_name", field, f"{what} {_short(value)} looks like a file path; it must be a plain name")
    if not pattern.fullmatch(value):
        raise _fail("invalid", field, f"{what} {_short(value)} must match {pattern.pattern}")


def _check_url(url: str, what: str, *, relative_ok: bool) -> str:
    """Accept absolute http(s) URLs and, if ``relative_ok``, plain relative paths; nothing else."""
    decoded = _unquote_fully(url)
    if _CONTROL.search(decoded) or "\\" in decoded or " " in url:
        raise _fail("unsafe_name", what, f"{what} {_short(url)} contains spaces, control characters "
                                   "or backslashes")
    scheme = _SCHEME.match(url)
    if scheme:
        if scheme.group(1).lower() not in ("http", "https"):
            raise _fail("unsafe_name", what, f"{what} {_short(url)} uses the {scheme.group(1)}: scheme; "
                                       "only http and https are allowed")
        if ".." in decoded:
            raise _fail("unsafe_name", what, f"{what} {_short(url)} contains '..'")
        if not urlsplit(url).hostname:
            raise _fail("invalid", what, f"{what} {_short(url)} has no host")
        return url
    if not relative_ok:
        if url.startswith(("/", "~")):
            raise _fail("unsafe_name", what, f"{what} {_short(url)} is a file path; use an http(s) URL")
        raise _fail("invalid", what, f"{what} {_short(url)} must be an absolute http or https URL")
    if url.startswith(("/", "~")):
        raise _fail("unsafe_name", what, f"{what} {_short(url)} is an absolute path; "
                                   "relative shard URLs must not start with '/' or '~'")
    if "%" in url or ".." in url:
        raise _fail("unsafe_name", what, f"{what} {_short(url)} contains '..' or percent-encoding")
    if not _REL_URL.fullmatch(url):
        raise _fail("invalid", what, f"{what} {_short(url)} must be a plain relative path "
                               "(letters, digits, '.', '_', '+', '-' and '/')")
    return url


def _check_multiaddr(value: str, field: str) -> None:
    if not _MULTIADDR.fullmatch(value):
        raise _fail("invalid", field, f"initial peer {_short(value)} is not a multiaddr "
                                      "like /ip4/1.2.3.4/tcp/31337/p2p/Qm...")


def _check_text(value: str, field: str) -> None:
    if _CONTROL.search(value.replace("\n", "").replace("\t", "")):
        raise _fail("invalid", field, "text must not contain control characters")


def _check_recipe(value: str) -> None:
    if value not in RECIPE_NAMES:
        raise _fail("unknown_recipe", "recipe", f"unknown recipe {_short(value)}; this app knows "
                                                f"{', '.join(sorted(RECIPE_NAMES))} (a newer app may know more)")


Multiaddr = Annotated[str, Meta(max_length=512)]
Line = Annotated[str, Meta(min_length=1, max_length=200)]
AwareDatetime = Annotated[datetime, Meta(tz=True)]


# --------------------------------------------------------------------------------------- schema
class _Model(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    pass


class HardwareMinimums(_Model):
    """What a volunteer's machine needs to join."""

    ram_gb: Annotated[float, Meta(ge=0, le=4096)]
    cpu_cores: Annotated[int, Meta(ge=1, le=1024)]
    disk_gb: Annotated[float, Meta(ge=0, le=100_000)]
    gpu_required: bool
    gpu_memory_gb: Annotated[float, Meta(gt=0, le=1024)] | None = None


class DataSource(_Model, kw_only=True):
    """Where the training data comes from. Relative shard URLs resolve against ``base_url`` or,
    when it is None, against the URL the catalog was fetched from."""

    base_url: Annotated[str, Meta(max_length=2048)] | None = None
    shards: Annotated[list[Shard], Meta(min_length=1, max_length=10_000)]
    # a declared model's (causal-lm, masked-lm): its tokenizer.json and a held-out token shard
    tokenizer: Shard | None = None
    eval: Shard | None = None
    # An invite-only experiment's backbone serves its shards to members only (a token in each
    # request) unless this says they are public; an open experiment's data is public either way
    public: bool = False

    def __post_init__(self) -> None:
        if self.base_url is not None:
            _check_url(self.base_url, "base_url", relative_ok=False)
            if not self.base_url.endswith("/"):
                msgspec.structs.force_setattr(self, "base_url", self.base_url + "/")
        for i, shard in enumerate(self.shards):
            _check_url(shard.url, f"shards[{i}].url", relative_ok=True)
        for name in ("tokenizer", "eval"):
            if getattr(self, name) is not None:
                _check_url(getattr(self, name).url, f"{name}.url", relative_ok=True)

    def files(self) -> list[Shard]:
        """What a volunteer fetches: the shards, then the tokenizer if there is one."""
        return [*self.shards, *([self.tokenizer] if self.tokenizer else [])]

class DilocoParams(_Model):
    """DiLoCo training (``mode: diloco``): ``inner_steps`` local optimizer steps (H), then the swarm
    averages the deltas from the last synced model, compressed by ``compression``, and an outer
    SGD (``outer_lr``, Nesterov momentum ``outer_momentum``, none if 0) applies the average.

    The defaults (lr 1.0, no momentum: the outer model becomes the average of the peers' models)
    did best for tiny-lm over 3 and 10 rounds (bench/README.md, diloco_sim.py: 10 rounds, eval loss 1.57
    against 1.94 with the DiLoCo paper's 0.7 / Nesterov 0.9, which it tuned over hundreds of
    rounds); an experiment meant to run that long may set the paper's values."""

    inner_steps: Annotated[int, Meta(ge=1, le=100_000)] = 100
    outer_lr: Annotated[float, Meta(gt=0, le=10)] = 1.0
    outer_momentum: Annotated[float, Meta(ge=0, lt=1)] = 0.0
    # "4bit": blockwise absmax, 0.52 bytes a value (engine/quant4.py); lossy codecs feed their
    # error back into the next round's delta (engine/delta_averaging.py)
    compression: Literal["none", "fp16", "8bit", "4bit"] = "8bit"
    # Every this many rounds each peer but the round's leader copies the leader's outer model
    # (0: never). Lossy deltas (8-bit) give each peer a slightly different average every round, so
    # the peers' outer models drift apart; this bounds the drift at the cost of one state download.
    resync_every: Annotated[int, Meta(ge=0, le=100_000)] = 10


class Experiment(_Model, kw_only=True):
    """One training run volunteers can join. ``mode`` is ``sync`` (DeDLOC: every global step
    averages gradients to reach ``target_batch_size``) or ``diloco`` (see ``DilocoParams``)."""

    id: str  # a slug: checked in __post_init__
    title: Line
    description: Annotated[str, Meta(max_length=10_000)] = ""
    organizer: Line
    recipe: str  # one of RECIPE_NAMES
    recipe_params: dict[str, Any] = {}
    run_id: str  # checked in __post_init__
    initial_peers: Annotated[list[Multiaddr], Meta(max_length=64)] = []
    target_batch_size: Annotated[int, Meta(ge=1, le=10_000_000)]
    batch_size_per_step: Annotated[int, Meta(ge=1, le=65_536)]
    matchmaking_time: Annotated[float, Meta(ge=0.1, le=600)]
    averaging_timeout: Annotated[float, Meta(ge=1, le=3600)]
    hardware: HardwareMinimums
    data: DataSource
    needs_token: bool = False
    # invite-only (needs_token): the issuer's Ed25519 public key (base64 of 32 raw bytes) that signs the
    # volunteers' tokens, and the backbone's HTTP root where codes are redeemed (``organizer/invites.py``)
    invite_key: Annotated[str, Meta(max_length=64)] | None = None
    invite_url: Annotated[str, Meta(max_length=2048)] | None = None
    status: Literal["active", "paused", "finished", "upcoming"]
    expires_at: AwareDatetime | None = None
    mode: Literal["sync", "diloco"] = "sync"
    # sync mode: average a step's gradients in the background while the next step accumulates, and
    # apply them one step late (DeDLOC's delayed updates); false: every step waits for its round
    overlap: bool = True
    # sync mode: global steps between parameter averaging rounds (gradients are averaged every step;
    # this bounds the drift that lossy gradients and failed rounds leave between peers). hivemind's
    # 1 sends the parameters (fp16) every step besides the gradients: a newcomer on a 20 Mbit/s link
    # then kept the whole swarm's rounds failing for 20-30 s (bench/join_time.py, bench/README.md)
    average_state_every: Annotated[int, Meta(ge=1, le=1000)] = 4
    # "client": volunteers use the swarm's DHT without serving it while a backbone (initial_peers)
    # answers, so the backbones serve every request: each volunteer's helpers used 0.005-0.012 of a
    # core less in the lab; with no backbone answering they serve it (engine/dht_fallback.py).
    # "server": reachable volunteers serve it too, as hivemind does (a swarm too large for its
    # backbones to answer)
    volunteer_dht: Literal["server", "client"] = "client"
    diloco: DilocoParams = DilocoParams()
    # How each peer combines the parts it reduces (engine/robust.py): a NaN/inf part is dropped either way
    aggregation: Literal["mean", "centered_clip"] = "mean"
    clip_radius: Annotated[float, Meta(gt=0.0, le=100.0)] = 1.0  # tau, in median distances from the median
    clip_iterations: Annotated[int, Meta(ge=1, le=20)] = 3

    def needs(self) -> HardwareMinimums:
        """The organizer's minimums, raised to what a declared model needs (``declared.fit``): a
        model too large or slow for a CPU needs a GPU with the memory its training takes."""
        if self.recipe not in DECLARED:
            return self.hardware
        f = fit(validate_params(self.recipe, self.recipe_params), self.batch_size_per_step)
        hw = self.hardware
        if not f.gpu_required:
            return msgspec.structs.replace(hw, ram_gb=max(hw.ram_gb, round(f.memory_gb + 1.0, 1)))
        return msgspec.structs.replace(hw, gpu_required=True,
                                       gpu_memory_gb=max(hw.gpu_memory_gb or 0.0, f.gpu_memory_gb or 0.0))

    def __post_init__(self) -> None:
        # the most specific problems first: unsafe names, then an unknown recipe, then values
        _check_name(self.id, _SLUG, "id", "id")
        _check_name(self.run_id, _RUN_ID, "run_id", "run_id")
        for name in ("title", "description", "organizer"):
            _check_text(getattr(self, name), name)
        if self.invite_url is not None:
            _check_url(self.invite_url, "invite_url", relative_ok=False)
        _check_recipe(self.recipe)
        for i, peer in enumerate(self.initial_peers):
            _check_multiaddr(peer, f"initial_peers[{i}]")
        try:
            typed = validate_params(self.recipe, self.recipe_params)
        except RecipeError as exc:
            cause = exc.__cause__
            if isinstance(cause, msgspec.ValidationError):
                where, reason = problem(cause)
                raise _fail("invalid_value" if _BOUND.match(reason) else "invalid",
                            f"recipe_params.{where}" if where else "recipe_params", reason) from None
            raise _fail("invalid", "recipe_params", exc.message) from None
        if self.recipe in DECLARED:
            try:
                check_fits(typed, self.batch_size_per_step)
            except ValueError as exc:
                raise _fail("invalid_value", "recipe_params", str(exc)) from None
        if (self.invite_key or self.invite_url) and not self.needs_token:
            raise _fail("invalid", "needs_token",
                        "invite_key and invite_url belong to an invite-only experiment (needs_token)")
        if self.invite_key is not None:
            try:
                raw = base64.b64decode(self.invite_key, validate=True)
            except ValueError:
                raw = b""
            if len(raw) != 32:
                raise _fail("invalid", "invite_key", "invite_key must be the base64 of a 32-byte Ed25519 public key")
        if self.batch_size_per_step > self.target_batch_size:
            raise _fail("invalid_value", "batch_size_per_step",
                        f"batch_size_per_step ({self.batch_size_per_step}) exceeds "
                        f"target_batch_size ({self.target_batch_size})")


class Catalog(_Model, kw_only=True):
    """A list of experiments, issued and signed by an organizer, valid until ``expires_at``."""

    schema_version: Literal[1]
    catalog_id: str  # a slug: checked in __post_init__
    issued_at: AwareDatetime
    expires_at: AwareDatetime
    experiments: Annotated[list[Experiment], Meta(max_length=1000)] = []

    def __post_init__(self) -> None:
        _check_name(self.catalog_id, _SLUG, "catalog_id", "id")
        if self.expires_at <= self.issued_at:
            raise _fail("invalid", "expires_at", "expires_at must be later than issued_at")
        seen: set[str] = set()
        for exp in self.experiments:
            if exp.id in seen:
                raise _fail("invalid", "experiments", f"duplicate experiment id {exp.id!r}")
            seen.add(exp.id)

    def get(self, exp_id: str) -> Experiment | None:
        """The experiment with id ``exp_id``, or None."""
        return next((exp for exp in self.experiments if exp.id == exp_id), None)

    def is_expired(self, now: datetime | None = None) -> bool:
        """Whether ``expires_at`` has passed at ``now`` (default: the current time)."""
        return self.expires_at <= (now or datetime.now(UTC))


def catalog_json(catalog: Catalog, indent: int = 0) -> str:
    """``catalog`` as JSON text, compact or with ``indent`` (what ``sign_catalog`` signs for a model):
    fields in schema order, UTF-8 text unescaped, UTC times as ``...Z``."""
    data = msgspec.json.encode(catalog)
    return (msgspec.json.format(data, indent=indent) if indent else data).decode()


def _explain(exc: msgspec.ValidationError) -> tuple[str, str]:
    """(code, ``path: reason``) of a schema error."""
    where, reason = problem(exc)
    cause = exc.__cause__
    if isinstance(cause, _Invalid):
        return cause.kind, f"{'.'.join(filter(None, (where, cause.field)))}: {reason}"
    return "invalid_value" if _BOUND.match(reason) else "invalid", f"{where or 'catalog'}: {reason}"


def validate_catalog(text: str | bytes | Mapping[str, Any] | Catalog) -> Catalog:
    """Check a catalog (JSON text, dict or model) against the schema; raise CatalogError if bad."""
    if isinstance(text, Catalog):
        text = msgspec.json.encode(text)
    elif isinstance(text, Mapping):
        try:
            text = json.dumps(text)
        except (RecursionError, ValueError, TypeError):  # nested too deeply, a huge int, not JSON values
            raise catalog_error("malformed", "The catalog is not JSON data.") from None
    try:
        data = msgspec.json.decode(text)  # all of it first: JSON nested too deeply is malformed, whatever it holds
    except (msgspec.DecodeError, UnicodeError, RecursionError):  # UnicodeError: a lone surrogate in a str
        raise catalog_error("malformed", "The catalog is not valid JSON.") from None
    try:
        return msgspec.convert(data, Catalog)
    except msgspec.ValidationError as exc:
        if not problem(exc)[0] and str(exc).startswith("Expected `object`"):
            raise catalog_error("malformed", "The catalog is not a JSON object.") from None
        raise catalog_error(*_explain(exc)) from None


def experiment_from(data: Mapping[str, Any]) -> Experiment:
    """An experiment from JSON data (a ``start`` command's); raise ValueError saying what is wrong."""
    try:
        return msgspec.json.decode(json.dumps(data), type=Experiment)
    except msgspec.ValidationError as exc:
        raise ValueError(_explain(exc)[1].removeprefix("catalog: ")) from None
    except (msgspec.DecodeError, UnicodeError, RecursionError, TypeError):
        raise ValueError("it is not JSON data") from None
