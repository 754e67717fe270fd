"""Where the swarm stands, as plain data: global step, samples/s, peers, learning curve, leaderboard.

The backbone feeds a ``SwarmView`` with the learning curve and the per-peer records it reads from
the DHT (already checked by ``metrics.fetch``), and serves ``SwarmView.to_json()`` at
``/swarm.json``. The app fetches that document with ``fetch_summary`` (off the GUI thread) and gets
a validated ``SwarmSummary`` (msgspec Structs). Imports no torch, hivemind, pydantic or Qt.

A peer's ``samples`` count from zero in each worker session; the leaderboard adds the sessions up
(a count that goes down starts a new session).

An invite-only experiment's backbone serves strangers ``to_json(public=True)``: the aggregates, the
learning curve and a leaderboard of display names and amounts only, with no peer id, no last-seen
time and nothing else that finds a member on the network (``redacted`` is then true); members send
their token (``fetch_summary(url, token=...)``) and get the full summary.
"""

from __future__ import annotations

import csv
import json
import logging
import threading
import time
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import Meta

from dedloc_core.errors import DedlocError
from dedloc_core.schema import coerce_floats, problem

logger = logging.getLogger(__name__)

CURVE_POINTS = 1000  # the learning curve keeps this many latest points
ACTIVE_SECONDS = 120.0  # a peer seen this recently counts as active on the leaderboard
MAX_SUMMARY_BYTES = 4 << 20


class _Doc(msgspec.Struct):
    def __post_init__(self) -> None:
        coerce_floats(self)


class CurvePoint(_Doc):
    time: float
    step: Annotated[int, Meta(ge=0)]
    loss: float | None = None
    samples_per_second: Annotated[float, Meta(ge=0.0)] = 0.0
    num_peers: Annotated[int, Meta(ge=0)] = 0
    eval_loss: float | None = None  # the backbone's model on the held-out data (a point of its own)


class Contributor(_Doc, kw_only=True):
    peer_id: Annotated[str, Meta(max_length=128)]
    display_name: Annotated[str, Meta(max_length=64)] = ""
    samples: Annotated[int, Meta(ge=0)]
    compute_seconds: Annotated[float, Meta(ge=0.0)] = 0.0
    last_seen: float = 0.0
    active: bool = False

    @property
    def name(self) -> str:
        """The volunteer's chosen name, or a short peer id (``ANONYMOUS`` when the view hides it)."""
        return self.display_name.strip() or short_peer_id(self.peer_id) or ANONYMOUS


class SwarmSummary(_Doc):
    run_id: str = ""
    updated: float = 0.0
    global_step: Annotated[int, Meta(ge=0)] = 0
    samples_per_second: Annotated[float, Meta(ge=0.0)] = 0.0
    num_peers: Annotated[int, Meta(ge=0)] = 0
    learning_curve: list[CurvePoint] = []
    leaderboard: list[Contributor] = []
    # the public view of an invite-only experiment: no peer ids, no per-peer last-seen times
    redacted: bool = False


ANONYMOUS = "(no name)"  # a volunteer without a display name, in a view without peer ids


def short_peer_id(peer_id: str) -> str:
    return f"…{peer_id[-8:]}" if len(peer_id) > 8 else peer_id


class SwarmView:
    """The backbone's running summary of the swarm. Thread-safe (the HTTP thread reads it)."""

    def __init__(self, run_id: str = ""):
        self.run_id = run_id
        self._lock = threading.Lock()
        self._curve: list[CurvePoint] = []
        self._peers: dict[str, dict] = {}  # peer_id -> banked, session, name, compute, last_seen
        self._status: tuple[int, float, int] | None = None  # step, samples/s, peers (latest reading)

    def set_status(self, step: int, samples_per_second: float, num_peers: int) -> None:
        """The latest global step, swarm samples/s and number of peers."""
        with self._lock:
            self._status = (max(0, step), max(0.0, samples_per_second), max(0, num_peers))

    def add_point(self, point: dict) -> None:
        """One learning-curve entry (as the backbone writes to learning_curve.jsonl)."""
        try:
            parsed = msgspec.convert(point, CurvePoint, strict=False)
        except msgspec.ValidationError:
            return
        with self._lock:
            self._curve.append(parsed)
            del self._curve[:-CURVE_POINTS]

    def add_record(self, peer_id: str, display_name: str, samples: int, compute_seconds: float, seen: float) -> None:
        """One verified per-peer record (cumulative over that peer's worker session)."""
        with self._lock:
            peer = self._peers.setdefault(peer_id, {"banked": 0, "session": 0, "banked_s": 0.0, "session_s": 0.0})
            if samples < peer["session"]:  # a new worker session
                peer["banked"] += peer["session"]
                peer["banked_s"] += peer["session_s"]
            peer.update(session=samples, session_s=compute_seconds, last_seen=max(seen, peer.get("last_seen", 0.0)))
            if display_name:
                peer["name"] = display_name

    def summary(self, now: float | None = None, *, public: bool = False) -> SwarmSummary:
        """The summary; ``public``: without peer ids or per-peer last-seen times (``redacted``)."""
        now = time.time() if now is None else now
        with self._lock:
            curve = list(self._curve)
            status = self._status
            board = [
                Contributor(peer_id=pid, display_name=p.get("name", ""), samples=p["banked"] + p["session"],
                            compute_seconds=p["banked_s"] + p["session_s"], last_seen=p["last_seen"],
                            active=now - p["last_seen"] <= ACTIVE_SECONDS)
                for pid, p in self._peers.items()
            ]
        board.sort(key=lambda c: (-c.samples, c.peer_id))
        if public:  # the order stays (by amount); what finds a peer on the network goes
            board = [msgspec.structs.replace(c, peer_id="", last_seen=0.0) for c in board]
        if status is None and curve:
            status = (curve[-1].step, curve[-1].samples_per_second, curve[-1].num_peers)
        step, sps, peers = status or (0, 0.0, 0)
        return SwarmSummary(run_id=self.run_id, updated=now, global_step=step, samples_per_second=sps,
                            num_peers=peers, learning_curve=curve, leaderboard=board, redacted=public)

    def to_json(self, public: bool = False) -> bytes:
        return msgspec.json.encode(self.summary(public=public))

    @classmethod
    def load(cls, run_dir: Path, run_id: str = "") -> SwarmView:
        """Rebuild from the backbone's files (``learning_curve.jsonl``, ``contributions.csv``)."""
        view = cls(run_id)
        curve = run_dir / "learning_curve.jsonl"
        if curve.exists():
            for line in curve.read_text(errors="replace").splitlines():
                try:
                    view.add_point(json.loads(line))
                except ValueError:
                    continue  # a line cut by a crash
        contrib = run_dir / "contributions.csv"
        if contrib.exists():
            with contrib.open(newline="", errors="replace") as f:
                for row in csv.DictReader(f):
                    try:
                        view.add_record(row["peer_id"], row.get("display_name") or "", int(row["samples"]),
                                        float(row["compute_seconds"]), float(row["time"]))
                    except (KeyError, TypeError, ValueError):
                        continue
        return view


class SwarmUnavailable(DedlocError):
    title = "Swarm status unavailable"


def parse_summary(data: bytes | str | dict) -> SwarmSummary:
    """Validate a swarm summary; raise ``SwarmUnavailable`` with a clear message if it is bad."""
    try:
        if not isinstance(data, dict):
            data = json.loads(data)
        return msgspec.convert(data, SwarmSummary, strict=False)
    except msgspec.ValidationError as exc:
        where, reason = problem(exc)
        raise SwarmUnavailable(f"The swarm summary is malformed ({where or 'summary'}: {reason}).") from exc
    except (ValueError, RecursionError) as exc:  # not JSON (UnicodeDecodeError is a ValueError)
        raise SwarmUnavailable(f"The swarm summary is malformed (not JSON: {str(exc)[:200]}).") from exc


def fetch_summary(url: str, timeout: float = 10.0, token: str | None = None) -> SwarmSummary:
    """GET ``url`` (e.g. the backbone's ``…/swarm.json``), with a member's ``token`` if given (an
    invite-only experiment's backbone then sends the full summary). Blocks: call it off the GUI thread."""
    import urllib.request  # here: it pulls in ssl, a few MB the page does not need

    if token:
        from dedloc_core.invites import plain_http_refusal

        refusal = plain_http_refusal(url, "an access token")
        if refusal is not None:
            raise SwarmUnavailable(refusal)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        request = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(request, timeout=timeout) as response:  # http(s) from the catalog
            data = response.read(MAX_SUMMARY_BYTES + 1)
    except OSError as exc:
        raise SwarmUnavailable(f"Could not reach {url}: {exc}") from exc
    if len(data) > MAX_SUMMARY_BYTES:
        raise SwarmUnavailable(f"The swarm summary at {url} is too large.")
    return parse_summary(data)
