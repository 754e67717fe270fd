"""The volunteer's preferences: one typed, versioned model kept as JSON in the user config directory.

Rules: the file carries ``version``; a file of an older version is migrated on load, a file that is
not JSON, does not validate, or comes from a newer version is moved aside as
``preferences.json.broken-<time>`` and replaced by defaults, with a warning the app shows. Writes are
atomic. Secrets (access tokens) are never stored here: they live in the OS keyring.
Field titles and descriptions are the labels and help texts of the app's form.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import time as clock
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import paths

logger = logging.getLogger(__name__)

PREFS_VERSION = 1
FILE_NAME = "preferences.json"
WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


class TimeWindow(BaseModel):
    """Contribute on these weekdays between ``start`` and ``end`` (local time; end may pass midnight)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    days: tuple[int, ...] = Field((0, 1, 2, 3, 4, 5, 6), description="Weekdays, 0 = Monday")
    start: clock = clock(0, 0)
    end: clock = clock(23, 59)

    @field_validator("days")
    @classmethod
    def _days(cls, days: tuple[int, ...]) -> tuple[int, ...]:
        if not days or any(d < 0 or d > 6 for d in days):
            raise ValueError("weekdays must be numbers 0 (Monday) to 6 (Sunday)")
        return tuple(sorted(set(days)))

    def label(self) -> str:
        names = ", ".join(WEEKDAYS[d].title() for d in self.days)
        return f"{names} {self.start:%H:%M}-{self.end:%H:%M}"


class Preferences(BaseModel):
    model_config = ConfigDict(extra="ignore", validate_assignment=True)

    version: int = PREFS_VERSION
    consent: bool = Field(False, title="I agree to lend this computer to the experiments I join")
    experiment_id: str | None = Field(None, title="Joined experiment", max_length=64)
    display_name: str = Field("", title="Name on the leaderboard", max_length=40,
                              description="Leave empty to appear as a short peer id.")
    # when
    idle_only: bool = Field(True, title="Only when I am not using the computer")
    idle_minutes: float = Field(3.0, ge=0.5, le=120.0, title="I am using the computer if I touched it in the last",
                                description="minutes")
    schedule: list[TimeWindow] = Field(default_factory=list, title="Only at these times",
                                       description="Empty: any time.")
    run_on_battery: bool = Field(False, title="Also when the computer runs on battery")
    other_cpu_limit: int | None = Field(50, ge=5, le=100, title="Pause when other programs use more CPU than",
                                        description="percent of all cores; empty: never")
    blocking_programs: list[str] = Field(default_factory=list, title="Pause while these programs run",
                                         description="Process names, e.g. games.")
    # how much
    cpu_share_idle: int = Field(100, ge=5, le=100, title="CPU share while I am away", description="percent of cores")
    cpu_share_in_use: int = Field(25, ge=5, le=100, title="CPU share while I use the computer",
                                  description="percent of cores")
    use_gpu: bool = Field(True, title="Use the GPU")
    gpu_while_in_use: bool = Field(False, title="Use the GPU while I use the computer")
    gpu_memory_cap_mb: int | None = Field(None, ge=256, le=1 << 20, title="GPU memory cap", description="MB")
    upload_cap_kbs: int | None = Field(None, ge=8, le=10_000_000, title="Upload cap", description="kB/s; empty: none")
    download_cap_kbs: int | None = Field(None, ge=8, le=10_000_000, title="Download cap",
                                         description="kB/s; empty: none")
    daily_quota_mb: int | None = Field(None, ge=10, le=10_000_000, title="Daily transfer quota",
                                       description="MB sent and received per day; empty: none")
    long_pause_minutes: float = Field(10.0, ge=1.0, le=1440.0, title="Free memory after a pause longer than",
                                      description="minutes")
    # app
    start_at_login: bool = Field(False, title="Start when I log in")

    @field_validator("blocking_programs")
    @classmethod
    def _programs(cls, names: list[str]) -> list[str]:
        cleaned = [n.strip() for n in names if n.strip()]
        if any(len(n) > 64 for n in cleaned):
            raise ValueError("a program name is longer than 64 characters")
        return cleaned

    @model_validator(mode="after")
    def _version(self) -> Preferences:
        if self.version != PREFS_VERSION:
            raise ValueError(f"preferences version {self.version}; this app reads version {PREFS_VERSION}")
        return self


@dataclass(frozen=True)
class Loaded:
    prefs: Preferences
    warning: str | None = None  # shown to the user when the file was broken and replaced
    backup: Path | None = None


def default_path() -> Path:
    return paths.config_dir() / FILE_NAME


def _migrate(data: dict) -> dict:
    """Bring an older file up to PREFS_VERSION. Each future version adds one step here."""
    data.setdefault("version", PREFS_VERSION)  # files written before versioning carry none
    return data


def load(path: Path | None = None) -> Loaded:
    """The saved preferences, defaults if there are none, or defaults and a warning if the file is bad."""
    path = path or default_path()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Loaded(Preferences())
    except OSError as exc:
        return _replace(path, f"could not be read ({exc.strerror})")
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return Loaded(Preferences.model_validate(_migrate(data)))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "file"
        return _replace(path, f"has an invalid value ({where}: {first['msg']})")
    except ValueError as exc:
        return _replace(path, f"is not valid JSON ({exc})")
    except RecursionError:  # json's C parser gives up on very deep nesting
        return _replace(path, "is not valid JSON (nested too deeply)")


def _replace(path: Path, problem: str) -> Loaded:
    backup = path.with_name(f"{path.name}.broken-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        path.replace(backup)
    except OSError:
        backup = None
    kept = f" It was kept as {backup.name}." if backup else ""
    warning = f"Your preferences file {problem}, so the defaults are in use.{kept}"
    logger.warning(warning)
    return Loaded(Preferences(), warning, backup)


def save(prefs: Preferences, path: Path | None = None) -> None:
    data = prefs.model_dump(mode="json")
    paths.atomic_write(path or default_path(), (json.dumps(data, indent=2) + "\n").encode())


def format_schedule(windows: list[TimeWindow]) -> str:
    """``Mon,Tue 22:00-06:30; Sat 00:00-23:59`` (the text form the app's form edits)."""
    return "; ".join(w.label() for w in windows)


def parse_schedule(text: str) -> list[TimeWindow]:
    """Parse ``format_schedule``'s text; day ranges like ``Mon-Fri`` work too. Raises ValueError."""
    windows = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        try:
            days_text, hours = part.rsplit(" ", 1)
            start, end = (clock.fromisoformat(h.strip()) for h in hours.split("-"))
        except ValueError:
            raise ValueError(f"{part!r}: write days then hours, like 'Mon-Fri 22:00-07:00'") from None
        days: list[int] = []
        for item in filter(None, (d.strip() for d in days_text.replace(" ", ",").split(","))):
            ends = [e.strip().lower()[:3] for e in item.split("-")]
            if any(e not in WEEKDAYS for e in ends) or len(ends) > 2:
                raise ValueError(f"{item!r} is not a weekday (Mon, Tue, ... Sun)")
            first, last = WEEKDAYS.index(ends[0]), WEEKDAYS.index(ends[-1])
            days.extend(range(first, last + 1) if first <= last else [*range(first, 7), *range(0, last + 1)])
        windows.append(TimeWindow(days=tuple(days), start=start, end=end))
    return windows
