"""The local contribution statistics: an SQLite file in the user data directory.

Per experiment and per hour it keeps samples, CPU and GPU compute seconds, averaging rounds, bytes
sent and received, and seconds paused by reason. Hours older than ``COMPACT_AFTER_DAYS`` are folded
into (UTC) days. The database runs in WAL mode with ``synchronous=NORMAL``: a committed transaction
survives a crash or ``kill -9`` of the process (not a power cut, which may lose the last commits).

The schema is versioned with ``PRAGMA user_version``; ``MIGRATIONS[n]`` turns version ``n`` into
``n + 1``. A file from a newer version, or one that is not a database, raises ``StatsError`` and is
left untouched. Imports no torch, hivemind or Qt (the GUI process uses it).
"""

from __future__ import annotations

import csv
import logging
import shutil
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from dedloc_core import paths
from dedloc_core.errors import DedlocError

logger = logging.getLogger(__name__)

HOUR = 3600
DAY = 86400
COMPACT_AFTER_DAYS = 30
FULL_BELOW = 1 << 20  # bytes free under which an error opening the file is put down to a full disk
COUNTERS = ("samples", "cpu_seconds", "gpu_seconds", "rounds", "bytes_sent", "bytes_received")

# v1: one row per experiment and hour, compute not split by device, pauses without a reason.
_V1 = """
CREATE TABLE hourly (
    experiment TEXT NOT NULL, hour INTEGER NOT NULL,
    samples INTEGER NOT NULL DEFAULT 0, compute_seconds REAL NOT NULL DEFAULT 0,
    rounds INTEGER NOT NULL DEFAULT 0, bytes_sent INTEGER NOT NULL DEFAULT 0,
    bytes_received INTEGER NOT NULL DEFAULT 0, paused_seconds REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (experiment, hour));
"""

# v2: buckets of one hour or one day (span), CPU and GPU seconds apart, pauses by reason.
_V2 = """
CREATE TABLE usage (
    experiment TEXT NOT NULL, start INTEGER NOT NULL, span INTEGER NOT NULL,
    samples INTEGER NOT NULL DEFAULT 0, cpu_seconds REAL NOT NULL DEFAULT 0,
    gpu_seconds REAL NOT NULL DEFAULT 0, rounds INTEGER NOT NULL DEFAULT 0,
    bytes_sent INTEGER NOT NULL DEFAULT 0, bytes_received INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (experiment, start, span));
CREATE TABLE paused (
    experiment TEXT NOT NULL, start INTEGER NOT NULL, span INTEGER NOT NULL, reason TEXT NOT NULL,
    seconds REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (experiment, start, span, reason));
INSERT INTO usage (experiment, start, span, samples, cpu_seconds, rounds, bytes_sent, bytes_received)
    SELECT experiment, hour * 3600, 3600, samples, compute_seconds, rounds, bytes_sent, bytes_received
    FROM hourly;
INSERT INTO paused (experiment, start, span, reason, seconds)
    SELECT experiment, hour * 3600, 3600, 'unknown', paused_seconds FROM hourly WHERE paused_seconds > 0;
DROP TABLE hourly;
"""

MIGRATIONS = [_V1, _V2]
SCHEMA_VERSION = len(MIGRATIONS)


class StatsError(DedlocError):
    title = "Statistics unavailable"


@dataclass
class Totals:
    """Sums over a period. ``paused`` maps a pause reason to seconds."""

    samples: int = 0
    cpu_seconds: float = 0.0
    gpu_seconds: float = 0.0
    rounds: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    paused: dict[str, float] = field(default_factory=dict)

    @property
    def compute_hours(self) -> float:
        return (self.cpu_seconds + self.gpu_seconds) / 3600

    @property
    def paused_seconds(self) -> float:
        return sum(self.paused.values())


@dataclass(frozen=True)
class Point:
    """One bucket of a series (``start`` is the bucket's first second, epoch time)."""

    start: int
    samples: int
    cpu_seconds: float
    gpu_seconds: float
    rounds: int
    bytes_sent: int
    bytes_received: int


@dataclass
class Delta:
    """Amounts to add to one experiment's hour (what the recorder collects between commits)."""

    counters: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    paused: dict[str, float] = field(default_factory=dict)

    def empty(self) -> bool:
        return not any(self.counters.values()) and not any(self.paused.values())


def default_path() -> Path:
    return paths.data_dir() / "stats.sqlite3"


def hour_of(t: float) -> int:
    return int(t // HOUR) * HOUR


PERIOD_TITLES = {"today": "Today", "week": "This week", "all": "All time"}


def period_starts(now: float | None = None) -> dict[str, float | None]:
    """Start of today and of this week (Monday) in local time; ``None`` for all time."""
    local = datetime.fromtimestamp(time.time() if now is None else now).astimezone()
    midnight = local.replace(hour=0, minute=0, second=0, microsecond=0)
    monday = midnight - timedelta(days=midnight.weekday())
    return {"today": midnight.timestamp(), "week": monday.timestamp(), "all": None}


class StatsStore:
    """One stats database. Used from one thread unless opened with ``threadsafe=True`` and a lock."""

    def __init__(self, path: Path | str | None = None, *, compact: bool = True, now: float | None = None,
                 threadsafe: bool = False, timeout: float = 10.0):
        self.path = Path(path) if path is not None else default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            # threadsafe: the caller serializes access (the recorder holds a lock)
            self.db = sqlite3.connect(self.path, isolation_level=None, timeout=timeout,
                                      check_same_thread=not threadsafe)
        except sqlite3.Error as exc:
            raise StatsError(f"Cannot open the statistics file {self.path}: {exc}.") from exc
        try:
            self._check_version()  # before WAL mode, which rewrites the header
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self._migrate()
        except StatsError:
            self.db.close()
            raise
        except sqlite3.DatabaseError as exc:
            self.db.close()
            if _disk_full(self.path.parent):  # SQLite says "disk I/O error" when it cannot make its -shm file
                raise StatsError(f"Cannot open the statistics file {self.path}: the disk is full. Free some "
                                 "space; the file was left as it is.") from exc
            raise StatsError(f"Cannot open the statistics file {self.path}: {exc}. It was left as it is; "
                             "move it away to start new statistics.") from exc
        if compact:
            try:
                self.compact(now=now)
            except sqlite3.Error as exc:  # a full disk: the rows stay as they are, folded next time
                logger.warning("Could not compact the statistics in %s: %s", self.path, exc)

    # ---- schema ---------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return int(self.db.execute("PRAGMA user_version").fetchone()[0])

    def _check_version(self) -> None:
        version = self.version
        if version > SCHEMA_VERSION:
            raise StatsError(f"The statistics file {self.path} is from a newer version of the app (schema "
                             f"{version}, this one knows {SCHEMA_VERSION}). It was left as it is.")

    def _migrate(self) -> None:
        for target in range(self.version, SCHEMA_VERSION):
            with self._transaction():
                for statement in _statements(MIGRATIONS[target]):
                    self.db.execute(statement)
                self.db.execute(f"PRAGMA user_version={target + 1}")

    def _transaction(self):
        return _Transaction(self.db)

    # ---- writing --------------------------------------------------------------------------------

    def add(self, deltas: dict[tuple[str, int], Delta]) -> None:
        """Add ``{(experiment, hour start): Delta}`` in one transaction."""
        with self._transaction():
            for (experiment, start), delta in deltas.items():
                c = delta.counters
                if any(c.values()):
                    self.db.execute(
                        "INSERT INTO usage VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                        "ON CONFLICT (experiment, start, span) DO UPDATE SET "
                        + ", ".join(f"{k} = {k} + excluded.{k}" for k in COUNTERS),
                        (experiment, start, HOUR, *(c[k] for k in COUNTERS)),
                    )
                for reason, seconds in delta.paused.items():
                    if seconds:
                        self._add_paused(experiment, start, HOUR, reason, seconds)

    def _add_paused(self, experiment: str, start: int, span: int, reason: str, seconds: float) -> None:
        self.db.execute(
            "INSERT INTO paused VALUES (?, ?, ?, ?, ?) ON CONFLICT (experiment, start, span, reason) "
            "DO UPDATE SET seconds = seconds + excluded.seconds",
            (experiment, start, span, reason, seconds),
        )

    def compact(self, older_than_days: int = COMPACT_AFTER_DAYS, now: float | None = None) -> int:
        """Fold hour rows older than ``older_than_days`` into UTC days; return the hour rows folded."""
        cutoff = (int(time.time() if now is None else now) // DAY - older_than_days) * DAY
        sums = ", ".join(f"SUM({k})" for k in COUNTERS)
        with self._transaction():
            self.db.execute(
                f"INSERT INTO usage SELECT experiment, start - start % {DAY}, {DAY}, {sums} FROM usage "
                "WHERE span = ? AND start < ? GROUP BY experiment, start - start % 86400 "
                "ON CONFLICT (experiment, start, span) DO UPDATE SET "
                + ", ".join(f"{k} = {k} + excluded.{k}" for k in COUNTERS),
                (HOUR, cutoff),
            )
            self.db.execute(
                f"INSERT INTO paused SELECT experiment, start - start % {DAY}, {DAY}, reason, SUM(seconds) "
                "FROM paused WHERE span = ? AND start < ? GROUP BY experiment, start - start % 86400, reason "
                "ON CONFLICT (experiment, start, span, reason) DO UPDATE SET seconds = seconds + excluded.seconds",
                (HOUR, cutoff),
            )
            folded = self.db.execute("DELETE FROM usage WHERE span = ? AND start < ?", (HOUR, cutoff)).rowcount
            self.db.execute("DELETE FROM paused WHERE span = ? AND start < ?", (HOUR, cutoff))
        return folded

    # ---- reading --------------------------------------------------------------------------------

    def experiments(self) -> list[str]:
        rows = self.db.execute("SELECT DISTINCT experiment FROM usage UNION SELECT DISTINCT experiment FROM paused")
        return sorted(r[0] for r in rows)

    def totals(self, since: float | None = None, experiment: str | None = None) -> Totals:
        """Sums over the buckets that start at or after ``since`` (all time if ``None``)."""
        where, args = _where(since, None, experiment)
        sums = ", ".join(f"COALESCE(SUM({k}), 0)" for k in COUNTERS)
        row = self.db.execute(f"SELECT {sums} FROM usage{where}", args).fetchone()
        paused = dict(self.db.execute(f"SELECT reason, SUM(seconds) FROM paused{where} GROUP BY reason", args))
        return Totals(int(row[0]), float(row[1]), float(row[2]), int(row[3]), int(row[4]), int(row[5]), paused)

    def summary(self, now: float | None = None, experiment: str | None = None) -> dict[str, Totals]:
        """Totals for today, this week and all time (local calendar)."""
        return {name: self.totals(since, experiment) for name, since in period_starts(now).items()}

    def series(self, bucket: str = "hour", since: float | None = None, until: float | None = None,
               experiment: str | None = None) -> list[Point]:
        """Sums per hour or per (local) day, oldest first; empty buckets are left out."""
        if bucket not in ("hour", "day"):
            raise ValueError(f"bucket must be 'hour' or 'day', not {bucket!r}")
        where, args = _where(since, until, experiment)
        sums = ", ".join(f"SUM({k})" for k in COUNTERS)
        rows = self.db.execute(f"SELECT start, {sums} FROM usage{where} GROUP BY start ORDER BY start", args)
        points: dict[int, list[float]] = {}
        for start, *values in rows:
            key = start if bucket == "hour" else local_midnight(start)
            acc = points.setdefault(key, [0] * len(COUNTERS))
            for i, v in enumerate(values):
                acc[i] += v
        return [Point(k, int(v[0]), float(v[1]), float(v[2]), int(v[3]), int(v[4]), int(v[5]))
                for k, v in sorted(points.items())]

    def export_csv(self, path: Path | str) -> int:
        """Write every bucket (hour or day rows, pauses by reason as columns); return the rows written."""
        reasons = [r[0] for r in self.db.execute("SELECT DISTINCT reason FROM paused ORDER BY reason")]
        pauses: dict[tuple, dict[str, float]] = {}
        for exp, start, span, reason, seconds in self.db.execute("SELECT * FROM paused"):
            pauses.setdefault((exp, start, span), {})[reason] = seconds
        keys = {(r[0], r[1], r[2]): r[3:] for r in self.db.execute("SELECT * FROM usage")}
        for key in pauses:
            keys.setdefault(key, (0,) * len(COUNTERS))
        out = Path(path)
        with out.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["experiment", "start_utc", "span_seconds", *COUNTERS,
                             *(f"paused_seconds[{r}]" for r in reasons)])
            for (exp, start, span), values in sorted(keys.items(), key=lambda kv: (kv[0][1], kv[0][0])):
                iso = datetime.fromtimestamp(start).astimezone().isoformat(timespec="seconds")
                extra = pauses.get((exp, start, span), {})
                writer.writerow([exp, iso, span, *values, *(round(extra.get(r, 0.0), 3) for r in reasons)])
        return len(keys)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> StatsStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Transaction:
    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, *exc: object) -> None:
        self.db.execute("COMMIT" if exc_type is None else "ROLLBACK")


def _where(since: float | None, until: float | None, experiment: str | None) -> tuple[str, list]:
    clauses, args = [], []
    if since is not None:
        clauses.append("start >= ?")
        args.append(since)
    if until is not None:
        clauses.append("start < ?")
        args.append(until)
    if experiment is not None:
        clauses.append("experiment = ?")
        args.append(experiment)
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), args


def _disk_full(folder: Path) -> bool:
    try:
        return shutil.disk_usage(folder).free < FULL_BELOW
    except OSError:
        return False


def local_midnight(t: float) -> int:
    """The start of the local calendar day that contains ``t``."""
    local = datetime.fromtimestamp(t).astimezone()
    return int(local.replace(hour=0, minute=0, second=0, microsecond=0).timestamp())


def _statements(script: str) -> Iterable[str]:
    return (s.strip() for s in script.split(";") if s.strip())
