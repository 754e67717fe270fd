"""The volunteer's preferences: one typed, versioned model kept as JSON in the user config directory.

Rules: the file carries ``version``; a file of an older version is migrated on load, a file that is
not JSON, does not validate, or comes from a newer version is moved aside as
``preferences.json.broken-<time>`` and replaced by defaults, with a warning the app shows. Writes are
atomic. Secrets (access tokens) are never stored here: they live in the OS keyring.
The model is a frozen msgspec Struct; its field titles and descriptions (``msgspec.Meta``) are the
labels and help texts of the app's form.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import sys
import time
from dataclasses import dataclass
from datetime import time as clock
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from . import paths
from .schema import coerce_floats, problem

logger = logging.getLogger(__name__)

PREFS_VERSION = 1
FILE_NAME = "preferences.json"
WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


class TimeWindow(msgspec.Struct, frozen=True):
    """Contribute on these weekdays between ``start`` and ``end`` (local time; end may pass midnight)."""

    days: Annotated[tuple[int, ...], Meta(description="Weekdays, 0 = Monday")] = (0, 1, 2, 3, 4, 5, 6)
    start: clock = clock(0, 0)
    end: clock = clock(23, 59)

    def __post_init__(self) -> None:
        if not self.days or any(d < 0 or d > 6 for d in self.days):
            raise ValueError("weekdays must be numbers 0 (Monday) to 6 (Sunday)")
        msgspec.structs.force_setattr(self, "days", tuple(sorted(set(self.days))))

    def label(self) -> str:
        names = ", ".join(WEEKDAYS[d].title() for d in self.days)
        return f"{names} {self.start:%H:%M}-{self.end:%H:%M}"


class Preferences(msgspec.Struct, frozen=True):
    """The volunteer's choices. Frozen: a change is a new value (``msgspec.structs.replace``, or
    ``validate`` for values that come from a person or a file)."""

    version: int = PREFS_VERSION
    consent: Annotated[bool, Meta(title="I agree to lend this computer to the experiments I join")] = False
    experiment_id: Annotated[str, Meta(max_length=64, title="Joined experiment")] | None = None
    display_name: Annotated[str, Meta(max_length=40, title="Name on the leaderboard",
                                      description="Leave empty to appear as a short peer id.")] = ""
    # when
    idle_only: Annotated[bool, Meta(title="Only when I am not using the computer")] = True
    idle_minutes: Annotated[float, Meta(ge=0.5, le=120.0, title="I am using the computer if I touched it in the last",
                                        description="minutes")] = 3.0
    schedule: Annotated[list[TimeWindow], Meta(title="Only at these times", description="Empty: any time.")] = []
    run_on_battery: Annotated[bool, Meta(title="Also when the computer runs on battery")] = False
    other_cpu_limit: Annotated[int, Meta(ge=5, le=100, title="Pause when other programs use more CPU than",
                                         description="percent of all cores; empty: never")] | None = 50
    blocking_programs: Annotated[list[str], Meta(title="Pause while these programs run",
                                                 description="Process names, e.g. games.")] = []
    # how much
    cpu_share_idle: Annotated[int, Meta(ge=5, le=100, title="CPU share while I am away",
                                        description="percent of cores")] = 100
    cpu_share_in_use: Annotated[int, Meta(ge=5, le=100, title="CPU share while I use the computer",
                                          description="percent of cores")] = 25
    use_gpu: Annotated[bool, Meta(title="Use the GPU")] = True
    gpu_while_in_use: Annotated[bool, Meta(title="Use the GPU while I use the computer")] = False
    gpu_memory_cap_mb: Annotated[int, Meta(ge=256, le=1 << 20, title="GPU memory cap",
                                           description="MB")] | None = None
    gpu_temp_limit_c: Annotated[int, Meta(ge=50, le=100, title="Pause the GPU at",
                                          description="°C, until it is 5 °C cooler; empty: never")] | None = 83
    upload_cap_kbs: Annotated[int, Meta(ge=8, le=10_000_000, title="Upload cap",
                                        description="kB/s; empty: none")] | None = None
    download_cap_kbs: Annotated[int, Meta(ge=8, le=10_000_000, title="Download cap",
                                          description="kB/s; empty: none")] | None = None
    daily_quota_mb: Annotated[int, Meta(ge=10, le=10_000_000, title="Daily transfer quota",
                                        description="MB sent and received per day; empty: none")] | None = None
    long_pause_minutes: Annotated[float, Meta(ge=1.0, le=1440.0, title="Free memory after a pause longer than",
                                              description="minutes")] = 10.0
    # app
    start_at_login: Annotated[bool, Meta(title="Start when I log in")] = False
    worker_command: Annotated[str, Meta(max_length=500, title="Run the worker with",
                                        description="A command that starts dedloc worker elsewhere, e.g. "
                                                    "ssh rig dedloc worker; empty: on this computer "
                                                    "(on Windows: in the DeDLOC WSL distro).")] = ""

    def __post_init__(self) -> None:
        coerce_floats(self)  # idle_minutes=5 is saved as 5.0, as it is read back
        cleaned = [n.strip() for n in self.blocking_programs if n.strip()]
        if any(len(n) > 64 for n in cleaned):
            raise ValueError("a program name is longer than 64 characters")
        msgspec.structs.force_setattr(self, "blocking_programs", cleaned)
        try:
            shlex.split(self.worker_command)
        except ValueError as exc:
            raise ValueError(f"the worker command cannot be read: {exc}") from None
        if self.version != PREFS_VERSION:
            raise ValueError(f"preferences version {self.version}; this app reads version {PREFS_VERSION}")

    def worker_argv(self) -> list[str] | None:
        """The worker command as arguments; None: the worker runs on this computer. On Windows, where
        no worker runs natively, the default is the WSL distro that the installer imports."""
        if not self.worker_command.strip() and sys.platform == "win32":
            return list(WSL_WORKER)
        return shlex.split(self.worker_command) or None


# The worker on Windows: in the WSL2 distro that installers/windows/dedloc.iss imports
# (installers/build_wsl.sh), run without a shell, driven over stdin and stdout.
WSL_WORKER = ("wsl.exe", "-d", "DeDLOC", "--exec", "/usr/bin/dedloc", "worker")

_HOURS_MINUTES = re.compile(r"^\d\d:\d\d$")


def validate(data: Any) -> Preferences:
    """Preferences from JSON-like data (a parsed file, the form's values); raises ``msgspec.ValidationError``.

    As before, numbers written as text and times without seconds (``"22:00"``) are accepted."""
    if isinstance(data, dict) and isinstance(data.get("schedule"), list):
        data = {**data, "schedule": [
            {k: v + ":00" if k in ("start", "end") and isinstance(v, str) and _HOURS_MINUTES.match(v) else v
             for k, v in w.items()} if isinstance(w, dict) else w for w in data["schedule"]]}
    return msgspec.convert(data, Preferences, strict=False)


def to_json(prefs: Preferences) -> dict[str, Any]:
    """``prefs`` as JSON data (what the file holds; ``validate`` reads it back)."""
    return msgspec.to_builtins(prefs)


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
        return Loaded(validate(_migrate(data)))
    except msgspec.ValidationError as exc:
        where, reason = problem(exc)
        return _replace(path, f"has an invalid value ({where or 'file'}: {reason})")
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
    data = to_json(prefs)
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
