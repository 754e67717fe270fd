"""The app <-> worker protocol: one JSON object per line, versioned, every message validated.

Commands (app -> worker, on the worker's stdin): start, pause, resume, set_limits, stop.
Events (worker -> app, on the worker's event channel): hello, state, progress, stats, log, error.

Each line is ``{"v": PROTOCOL_VERSION, "type": "<name>", ...fields}``. A line that is not valid JSON,
has another version, an unknown type or wrong fields raises ``ProtocolError``; the worker answers
such a command with an ``error`` event and carries on.
"""

from __future__ import annotations

import json
import reprlib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from .errors import ProtocolError

PROTOCOL_VERSION = 1
MAX_LINE = 1 << 20


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---- commands -------------------------------------------------------------------------------


class Limits(_Message):
    """Resource limits. ``None`` leaves a limit unchanged (or unlimited at start); for the byte
    caps and the GPU memory cap, 0 means "no cap"."""

    cpu_threads: int | None = Field(None, ge=1, le=1024)
    use_gpu: bool | None = None
    upload_bps: int | None = Field(None, ge=0)
    download_bps: int | None = Field(None, ge=0)
    gpu_memory_mb: int | None = Field(None, ge=0)  # cap on this worker's GPU memory (0 = none)


class Start(_Message):
    type: Literal["start"] = "start"
    experiment: dict[str, Any]
    initial_peers: list[str] | None = None
    data_base_url: str | None = None
    identity_path: str | None = None
    host_maddrs: list[str] = ["/ip4/127.0.0.1/tcp/0"]
    announce_maddrs: list[str] = []
    client_mode: bool = False
    batch_size: int | None = Field(None, ge=1, le=65536)
    seed: int = 0
    progress_period: float = Field(1.0, gt=0.0, le=3600.0)
    limits: Limits = Limits()
    start_paused: bool = False
    display_name: str = Field("", max_length=64)  # shown on the swarm's leaderboard ("" = short peer id)
    bandwidth: float | None = Field(None, gt=0)  # declared Mbit/s for DeDLOC's load balancing (a hint)
    grad_compression: Literal["none", "fp16", "8bit"] | None = None  # None: fp16
    reachability: Literal["auto", "direct", "relay", "outbound"] = "auto"


class Pause(_Message):
    type: Literal["pause"] = "pause"
    reason: str = ""


class Resume(_Message):
    type: Literal["resume"] = "resume"


class SetLimits(_Message):
    type: Literal["set_limits"] = "set_limits"
    limits: Limits


class Stop(_Message):
    type: Literal["stop"] = "stop"


Command = Annotated[Start | Pause | Resume | SetLimits | Stop, Field(discriminator="type")]

# ---- events ---------------------------------------------------------------------------------

WorkerState = Literal["idle", "preparing", "joining", "training", "paused", "stopping", "stopped"]


class Hello(_Message):
    type: Literal["hello"] = "hello"
    protocol: int = PROTOCOL_VERSION
    version: str
    pid: int


class State(_Message):
    type: Literal["state"] = "state"
    state: WorkerState
    reason: str = ""
    peer_id: str | None = None
    maddrs: list[str] = []
    reachability: str | None = None  # "direct", "via relay", "relay lost" or "outbound only" once joined


class Progress(_Message):
    type: Literal["progress"] = "progress"
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


class Stats(_Message):
    """Cumulative totals of this worker process since it started."""

    type: Literal["stats"] = "stats"
    samples: int
    compute_seconds: float
    rounds: int
    bytes_sent: int
    bytes_received: int
    paused_seconds: float
    averaging_seconds: float = 0.0  # time spent in gradient averaging rounds
    device: Literal["cpu", "gpu"] = "cpu"  # where compute_seconds since the last stats event were spent


class Log(_Message):
    type: Literal["log"] = "log"
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
    message: str
    logger: str = ""


class Error(_Message):
    type: Literal["error"] = "error"
    code: str
    title: str
    message: str
    hint: str = ""  # what the user can do (errors.user_message)
    fatal: bool = False


Event = Annotated[Hello | State | Progress | Stats | Log | Error, Field(discriminator="type")]

_COMMANDS: TypeAdapter[Any] = TypeAdapter(Command)
_EVENTS: TypeAdapter[Any] = TypeAdapter(Event)


def encode(message: _Message) -> str:
    """One protocol line (with trailing newline)."""
    body = message.model_dump(mode="json")
    return json.dumps({"v": PROTOCOL_VERSION, **body}, separators=(",", ":")) + "\n"


def _decode(line: str | bytes, adapter: TypeAdapter[Any]) -> Any:
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
        return adapter.validate_python(data)
    except ValidationError as exc:
        kind = data.get("type")
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ProtocolError(f"Bad {reprlib.repr(kind)} message: {_clip(where)}: {_clip(first['msg'])}",
                            code="invalid") from exc


def _clip(text: str, limit: int = 200) -> str:
    """``text``, cut to ``limit`` characters: a message quotes what it got, and that may be huge."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def decode_command(line: str | bytes) -> Start | Pause | Resume | SetLimits | Stop:
    return _decode(line, _COMMANDS)


def decode_event(line: str | bytes) -> Hello | State | Progress | Stats | Log | Error:
    return _decode(line, _EVENTS)
