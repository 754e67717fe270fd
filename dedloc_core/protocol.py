"""The app <-> worker protocol: one JSON object per line, versioned, every message validated.

Commands (app -> worker, on the worker's stdin): start, pause, resume, set_limits, stop.
Events (worker -> app, on the worker's event channel): hello, state, progress, stats, log, error.

Each line is ``{"v": PROTOCOL_VERSION, "type": "<name>", ...fields}``. A line that is not valid JSON,
has another version, an unknown type or wrong fields raises ``ProtocolError``; the worker answers
such a command with an ``error`` event and carries on. Messages are frozen msgspec Structs tagged by
``type``; their constraints are checked when a line is decoded (numbers given as text or as floats
with an integral value are accepted for numeric fields, as before).
"""

from __future__ import annotations

import json
import reprlib
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from .errors import ProtocolError
from .schema import coerce_floats, problem

PROTOCOL_VERSION = 1
MAX_LINE = 1 << 20


class _Message(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Any protocol message (and ``Limits``, which travels inside them)."""

    def __post_init__(self) -> None:
        coerce_floats(self)  # a whole number given for a float field goes out as 3.0, as before


class _Tagged(_Message, tag_field="type"):
    @property
    def type(self) -> str:
        """The message's name on the wire (``"start"``, ``"progress"``, ...)."""
        return self.__struct_config__.tag  # type: ignore[return-value]


# ---- commands -------------------------------------------------------------------------------


class Limits(_Message):
    """Resource limits. ``None`` leaves a limit unchanged (or unlimited at start); for the byte
    caps and the GPU memory cap, 0 means "no cap"."""

    cpu_threads: Annotated[int, Meta(ge=1, le=1024)] | None = None
    use_gpu: bool | None = None
    upload_bps: Annotated[int, Meta(ge=0)] | None = None
    download_bps: Annotated[int, Meta(ge=0)] | None = None
    gpu_memory_mb: Annotated[int, Meta(ge=0)] | None = None  # cap on this worker's GPU memory (0 = none)

    def merged(self, update: Limits) -> Limits:
        """These limits with the ones that ``update`` sets (its ``None`` fields change nothing)."""
        changes = {name: value for name in update.__struct_fields__ if (value := getattr(update, name)) is not None}
        return msgspec.structs.replace(self, **changes)


class Start(_Tagged, tag="start"):
    experiment: dict[str, Any]
    initial_peers: list[str] | None = None
    data_base_url: str | None = None
    identity_path: str | None = None
    host_maddrs: list[str] = msgspec.field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: list[str] = []
    client_mode: bool = False
    batch_size: Annotated[int, Meta(ge=1, le=65536)] | None = None
    seed: int = 0
    progress_period: Annotated[float, Meta(gt=0.0, le=3600.0)] = 1.0
    limits: Limits = Limits()
    start_paused: bool = False
    display_name: Annotated[str, Meta(max_length=64)] = ""  # shown on the swarm's leaderboard ("" = short peer id)
    bandwidth: Annotated[float, Meta(gt=0)] | None = None  # declared Mbit/s for DeDLOC's load balancing (a hint)
    grad_compression: Literal["none", "fp16", "8bit"] | None = None  # None: fp16
    reachability: Literal["auto", "direct", "relay", "outbound"] = "auto"
    # an invite-only experiment's code, from the app's keyring, for a worker that cannot read it (across
    # a boundary); None: the worker reads its own keyring
    invite_code: Annotated[str, Meta(max_length=256)] | None = None


class Pause(_Tagged, tag="pause"):
    reason: str = ""


class Resume(_Tagged, tag="resume"):
    pass


class SetLimits(_Tagged, tag="set_limits"):
    limits: Limits


class Stop(_Tagged, tag="stop"):
    pass


Command = Start | Pause | Resume | SetLimits | Stop

# ---- events ---------------------------------------------------------------------------------

WorkerState = Literal["idle", "preparing", "joining", "training", "paused", "stopping", "stopped"]


class Hello(_Tagged, tag="hello", kw_only=True):
    protocol: int = PROTOCOL_VERSION
    version: str
    pid: int
    host: str = ""  # the worker's host name: where it runs, shown when it runs across a boundary


class State(_Tagged, tag="state"):
    state: WorkerState
    reason: str = ""
    peer_id: str | None = None
    maddrs: list[str] = []
    reachability: str | None = None  # "direct", "via relay", "relay lost" or "outbound only" once joined


class Progress(_Tagged, tag="progress"):
    local_epoch: int
    global_step: int
    samples_per_second: float
    swarm_samples_per_second: float
    loss: float | None
    num_peers: int
    samples_accumulated: int
    target_batch_size: int
    bytes_sent: int
    bytes_received: int
    param_digest: list[float] = []
    mode: str | None = None  # the experiment's training mode, "sync" or "diloco"
    next_sync_in: float | None = None  # diloco: seconds to this peer's next outer sync (0 while one runs)
    reachability: str | None = None  # "direct", "via relay" or "outbound only"
    device: str = ""  # what it trains on: "CPU" or the GPU's name
    device_note: str = ""  # on the CPU though a GPU may be there: why ("GPU support not installed", ...)
    gpu_runtime: str | None = None  # the GPU runtime in use (dedloc_core.gpu_runtime); None: the bundled torch


class Stats(_Tagged, tag="stats"):
    """Cumulative totals of this worker process since it started."""

    samples: int  # computed
    compute_seconds: float
    rounds: int
    bytes_sent: int
    bytes_received: int
    paused_seconds: float
    averaging_seconds: float = 0.0  # time spent in gradient averaging rounds
    samples_dropped: int = 0  # of ``samples``, those a state load dropped before they reached a step
    rounds_failed: int = 0  # gradient rounds of this worker process that failed (it stepped on its own)
    device: Literal["cpu", "gpu"] = "cpu"  # where compute_seconds since the last stats event were spent


class Log(_Tagged, tag="log"):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
    message: str
    logger: str = ""


class Error(_Tagged, tag="error"):
    code: str
    title: str
    message: str
    hint: str = ""  # what the user can do (errors.user_message)
    fatal: bool = False


Event = Hello | State | Progress | Stats | Log | Error


def _plain(value: Any) -> Any:
    """A number the engine hands over as a numpy or torch scalar, as a Python number."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"a {type(value).__name__} cannot go into a protocol message")


def encode(message: _Message) -> str:
    """One protocol line (with trailing newline)."""
    body = msgspec.to_builtins(message, enc_hook=_plain)
    return json.dumps({"v": PROTOCOL_VERSION, **body}, separators=(",", ":")) + "\n"


def _decode(line: str | bytes, kind: Any) -> Any:
    if len(line) > MAX_LINE:
        raise ProtocolError(f"Message too long ({len(line)} bytes).", code="too_long")
    try:
        data = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"Not JSON: {exc}", code="not_json") from exc
    except RecursionError:  # json's C parser gives up on very deep nesting
        raise ProtocolError("Not JSON: nested too deeply.", code="not_json") from None
    if not isinstance(data, dict):
        raise ProtocolError("A message must be a JSON object.", code="not_object")
    version = data.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"Protocol version {reprlib.repr(version)}; expected {PROTOCOL_VERSION}.",
                            code="version")
    try:
        return msgspec.convert(data, kind, strict=False)
    except msgspec.ValidationError as exc:
        where, reason = problem(exc)
        raise ProtocolError(f"Bad {reprlib.repr(data.get('type'))} message: {_clip(where or 'message')}: "
                            f"{_clip(reason)}", code="invalid") from exc
    except UnicodeEncodeError as exc:  # a lone surrogate (JSON's "\ud800") in a key msgspec must encode
        raise ProtocolError(f"Bad {reprlib.repr(data.get('type'))} message: a string is not valid UTF-8.",
                            code="invalid") from exc


def _clip(text: str, limit: int = 200) -> str:
    """``text``, cut to ``limit`` characters: a message quotes what it got, and that may be huge."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def decode_command(line: str | bytes) -> Start | Pause | Resume | SetLimits | Stop:
    return _decode(line, Command)


def decode_event(line: str | bytes) -> Hello | State | Progress | Stats | Log | Error:
    return _decode(line, Event)
