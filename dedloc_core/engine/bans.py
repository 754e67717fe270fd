"""One ban list per worker: shared by its averagers and its main process, kept across restarts, and
reported to the backbone of an invite-only experiment.

A ban is (peer id, reason, since, until), in wall-clock seconds so that it means the same after a
restart. ``robust.strike`` and ``robust.ban`` make them (a NaN part, a wrong reduction, a failed
check) inside whichever averager saw the offence; ``banned`` is asked by every averager's
matchmaking and state download (``hivemind_ext.robust_reduce``).

- **Shared**: the bans live in a small table in shared memory (``MAX_BANS`` slots of fixed size,
  ``multiprocessing.RawArray`` and a lock), made by ``load`` in the worker before hivemind forks
  its DHT and averagers, which inherit it; helper threads (``DEDLOC_HELPER_THREADS``) see the same
  memory. So a peer the gradient averager bans is refused by the state averager at once, and the
  main process sees it. Chosen over a locked file because ``banned`` runs on every matchmaking
  request and state download inside the averagers' event loops: a scan of the shared table takes
  about 0.1 ms (256 slots, measured) and no system call, where a file would cost a stat, an open
  and a parse (and a file lock) on each.
- **Persisted**: each new ban rewrites ``<data dir>/bans/<run id>.json`` (``paths.atomic_write``,
  under the table's lock, by the process that banned). ``load(run_id)`` reads it when a session
  starts and drops the bans that expired; a file that cannot be read is a warning and no bans.
- **Reported**: ``Reporter`` (main process, its own thread, invite-only experiments) posts each
  peer banned during this session to the backbone (``invites.report``) at most once; a failed
  report is a log line.

A process that never called ``load`` (a test) gets a table of its own on first use, kept in memory
only. The backbone's keeper loads its list from its run dir (``bans/``).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import math
import multiprocessing as mp
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dedloc_core import paths

logger = logging.getLogger(__name__)

MAX_BANS = 256  # when full, a new ban takes the slot of the one that ends first
FORMAT = 1
_PEER, _REASON = 64, 64  # bytes: a base58 peer id has 46 to 52 characters


class _Slot(ctypes.Structure):
    _fields_ = [("peer", ctypes.c_char * _PEER), ("reason", ctypes.c_char * _REASON),
                ("since", ctypes.c_double), ("until", ctypes.c_double)]


@dataclass(frozen=True)
class Ban:
    peer: str
    reason: str
    since: float
    until: float


_table: Any = None  # RawArray(_Slot, MAX_BANS); a slot with an empty peer is free
_serial: Any = None  # RawValue: bumped by every ban (the reporter watches it)
_lock: Any = None
_file: list[Path | None] = [None]  # where this worker's bans are kept (set by ``load``)


def _setup() -> None:
    global _table, _serial, _lock
    if _table is None:
        _table, _serial, _lock = mp.RawArray(_Slot, MAX_BANS), mp.RawValue(ctypes.c_uint64, 0), mp.Lock()


def file_for(run_id: str, directory: Path | None = None) -> Path:
    """The ban file of ``run_id`` (in ``directory``, default the user's data dir)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", run_id)[:80]
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:8]
    return (directory or paths.data_dir() / "bans") / f"{safe}-{digest}.json"


def load(run_id: str, directory: Path | None = None, now: float | None = None) -> list[Ban]:
    """Make (or clear) the shared table, before hivemind forks, and load ``run_id``'s bans from its
    file; return the bans still in force."""
    _setup()
    path = file_for(run_id, directory)
    loaded = _read(path, time.time() if now is None else now)
    with _lock:
        _file[0] = path
        ctypes.memset(_table, 0, ctypes.sizeof(_table))
        for slot, ban in zip(_table, loaded[:MAX_BANS], strict=False):
            slot.peer, slot.reason = ban.peer.encode(), ban.reason.encode()[:_REASON - 1]
            slot.since, slot.until = ban.since, ban.until
    if loaded:
        logger.info("%d peer(s) still banned from an earlier session (%s)", len(loaded), path)
    return loaded[:MAX_BANS]


def close() -> None:
    """Forget the bans and the file (the session ended); later bans stay in memory only."""
    if _table is not None:
        with _lock:
            _file[0] = None
            ctypes.memset(_table, 0, ctypes.sizeof(_table))


def _read(path: Path, now: float) -> list[Ban]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        logger.warning("Cannot read the ban list %s (%s): starting with no bans", path, exc)
        return []
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("bans"), list):
            raise ValueError("not a ban list")
        bans = []
        for entry in doc["bans"]:
            peer, reason = str(entry["peer"]), str(entry["reason"])
            since, until = float(entry["since"]), float(entry["until"])
            if not (0 < len(peer.encode()) < _PEER and math.isfinite(since) and math.isfinite(until)):
                raise ValueError(f"a bad entry: {entry!r:.80}")
            if until > now:
                bans.append(Ban(peer, reason, since, until))
        return bans
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        logger.warning("The ban list %s is broken (%s): starting with no bans", path, exc)
        return []


def _write() -> None:
    """Keep the bans in force in the file (the caller holds the lock)."""
    path = _file[0]
    if path is None:
        return
    now = time.time()
    entries = [{"peer": s.peer.decode(), "reason": s.reason.decode(errors="replace"), "since": s.since,
                "until": s.until} for s in _table if s.peer and s.until > now]
    try:
        paths.atomic_write(path, json.dumps({"format": FORMAT, "bans": entries}, indent=1).encode())
    except OSError as exc:  # the ban holds in memory for this session all the same
        logger.warning("Cannot save the ban list %s: %s", path, exc)


def ban(peer: str, reason: str, seconds: float, now: float | None = None) -> bool:
    """Ban ``peer`` for ``seconds`` from ``now`` (wall clock) in every averager of this worker; True
    unless it was banned already for at least as long."""
    now = time.time() if now is None else now
    key = peer.encode()
    if not 0 < len(key) < _PEER:
        logger.warning("Not banning %r: not a peer id", peer[:80])
        return False
    _setup()
    with _lock:
        free = None
        for slot in _table:
            if slot.peer == key:
                if slot.until >= now + seconds:
                    return False
                free = slot
                break
            if free is None and (not slot.peer or slot.until <= now):
                free = slot
        if free is None:
            free = min(_table, key=lambda s: s.until)
        if free.peer != key or free.until <= now:
            free.since = now
        free.peer, free.reason, free.until = key, reason.encode()[:_REASON - 1], now + seconds
        _serial.value += 1
        _write()
    return True


def banned(peer: str, now: float | None = None) -> bool:
    if _table is None:
        return False
    now = time.time() if now is None else now
    key = str(peer).encode()
    with _lock:
        return any(slot.peer == key and slot.until > now for slot in _table)


def active(now: float | None = None) -> list[Ban]:
    """The bans in force."""
    if _table is None:
        return []
    now = time.time() if now is None else now
    with _lock:
        return [Ban(s.peer.decode(), s.reason.decode(errors="replace"), s.since, s.until)
                for s in _table if s.peer and s.until > now]


def serial() -> int:
    """A number that changes with every ban."""
    return 0 if _serial is None else int(_serial.value)


class Reporter:
    """Reports each peer this worker bans during the session to the experiment's backbone, once,
    from its own thread: ``invites.report`` signed with this peer's identity."""

    def __init__(self, invite_url: str, identity, run_id: str, poll: float = 1.0):
        self.invite_url, self.identity, self.run_id, self.poll = invite_url, identity, run_id, poll
        self.began = time.time()
        self.reported: dict[str, bool] = {}  # peer -> whether the backbone recorded it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ban-reporter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seen = -1
        while not self._stop.is_set():
            if serial() != seen:
                seen = serial()
                for b in active():
                    if b.since >= self.began and b.peer not in self.reported:
                        self.reported[b.peer] = self._report(b)
            self._stop.wait(self.poll)

    def _report(self, b: Ban) -> bool:
        from dedloc_core import invites

        try:
            invites.report(self.invite_url, self.identity, self.run_id, b.peer, b.reason)
        except invites.InviteError as exc:
            logger.warning("Could not report banned peer %s to the organizer: %s", b.peer, exc.message)
            return False
        logger.info("Reported banned peer %s (%s) to the organizer", b.peer, b.reason)
        return True

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
