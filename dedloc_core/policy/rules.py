"""The contribution policy: whether to train right now, why, and within which limits.

``decide(inputs, prefs)`` is a pure function (no clock, no I/O): the caller samples the machine
(``sampler.Sampler``) and passes the time. ``Contributor`` (``contributor``) turns a stream of
decisions into commands for the worker. Idle time unknown (no idle source) counts as "the user is
present": the schedule alone decides, with the in-use limits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

from dedloc_core.prefs import Preferences, TimeWindow, format_schedule
from dedloc_core.protocol import Limits

GPU_COOL_C = 5  # a GPU taken off for its heat comes back this much below the limit


@dataclass(frozen=True)
class Inputs:
    """What the sampler saw, plus the user's own choices."""

    now: datetime  # local time
    idle_seconds: float | None = None  # None: no idle source (the user counts as present)
    on_battery: bool = False
    other_cpu_percent: float = 0.0  # CPU used by other programs, percent of all cores
    gpu_busy: bool = False  # another process computes on the GPU
    gpu_temp_c: float | None = None  # the hottest GPU's temperature; None: no reading
    gpu_cooling: bool = False  # the last decision took the GPU off for its heat (hysteresis)
    programs: frozenset[str] = frozenset()  # names of the running processes (not ours)
    threads: int = 1  # logical CPUs of this computer
    user_paused: bool = False
    snoozed_until: datetime | None = None
    gpu_snoozed_until: datetime | None = None
    quota_used: bool = False  # today's transfer quota is spent


@dataclass(frozen=True)
class Decision:
    run: bool
    reason: str  # for people: the tray's tooltip
    limits: Limits = field(default_factory=Limits)
    in_use: bool = False  # the user counts as present
    gpu_hot: bool = False  # the GPU is off for its heat: the next decision's ``gpu_cooling``


def decide(inputs: Inputs, prefs: Preferences) -> Decision:
    """Run or pause, with a reason a person understands and the limits to run within."""
    now = inputs.now
    in_use = inputs.idle_seconds is None or inputs.idle_seconds < prefs.idle_minutes * 60
    hot = gpu_too_hot(inputs, prefs)
    limits = _limits(inputs, prefs, in_use, hot)

    def pause(reason: str) -> Decision:
        return Decision(False, reason, limits, in_use, hot)

    if inputs.user_paused:
        return pause("Paused by you")
    if inputs.snoozed_until is not None and now < inputs.snoozed_until:
        return pause(f"Snoozed until {inputs.snoozed_until:%H:%M}")
    if inputs.quota_used:
        return pause(f"Today's transfer quota ({prefs.daily_quota_mb} MB) is used up; resuming at midnight")
    if inputs.on_battery and not prefs.run_on_battery:
        return pause("Running on battery")
    if prefs.schedule and not in_schedule(prefs.schedule, now):
        return pause(f"Outside your schedule ({format_schedule(prefs.schedule)})")
    blocking = sorted(_running(prefs.blocking_programs, inputs.programs))
    if blocking:
        return pause(f"{blocking[0]} is running")
    if prefs.other_cpu_limit is not None and inputs.other_cpu_percent > prefs.other_cpu_limit:
        return pause(f"Other programs use {inputs.other_cpu_percent:.0f}% of the CPU")
    if in_use and prefs.idle_only and inputs.idle_seconds is not None:
        return pause("You are using the computer")

    notes = []
    if inputs.idle_seconds is None:
        notes.append("no idle detection: on schedule only")
    elif in_use:
        notes.append(f"you are using the computer: {prefs.cpu_share_in_use}% CPU")
    if prefs.use_gpu and not limits.use_gpu:
        if inputs.gpu_snoozed_until is not None and now < inputs.gpu_snoozed_until:
            notes.append(f"GPU snoozed until {inputs.gpu_snoozed_until:%H:%M}")
        elif hot:
            notes.append(f"GPU at {inputs.gpu_temp_c:.0f} °C: off until {prefs.gpu_temp_limit_c - GPU_COOL_C} °C")
        elif inputs.gpu_busy:
            notes.append("GPU left to another program")
        elif in_use:
            notes.append("GPU off while you use the computer")
    reason = "Contributing" + (f" ({'; '.join(notes)})" if notes else "")
    return Decision(True, reason, limits, in_use, hot)


def gpu_too_hot(inputs: Inputs, prefs: Preferences) -> bool:
    """At or above the user's limit; once off, the GPU stays off until ``GPU_COOL_C`` below it, so
    that it does not go on and off around the limit every few seconds."""
    limit, temp = prefs.gpu_temp_limit_c, inputs.gpu_temp_c
    if limit is None or temp is None:
        return False
    return temp >= limit or (inputs.gpu_cooling and temp > limit - GPU_COOL_C)


def _limits(inputs: Inputs, prefs: Preferences, in_use: bool, hot: bool) -> Limits:
    share = prefs.cpu_share_in_use if in_use else prefs.cpu_share_idle
    gpu_snoozed = inputs.gpu_snoozed_until is not None and inputs.now < inputs.gpu_snoozed_until
    use_gpu = (prefs.use_gpu and not gpu_snoozed and not inputs.gpu_busy and not hot
               and (prefs.gpu_while_in_use or not in_use))
    return Limits(
        cpu_threads=max(1, round(max(1, inputs.threads) * share / 100)),
        use_gpu=use_gpu,
        upload_bps=prefs.upload_cap_kbs * 1000 if prefs.upload_cap_kbs else 0,
        download_bps=prefs.download_cap_kbs * 1000 if prefs.download_cap_kbs else 0,
        gpu_memory_mb=prefs.gpu_memory_cap_mb or 0,
    )


def in_schedule(windows: list[TimeWindow], now: datetime) -> bool:
    """Whether ``now`` falls in one of the windows (an end before the start passes midnight)."""
    minute = now.hour * 60 + now.minute
    today, yesterday = now.weekday(), (now - timedelta(days=1)).weekday()
    for w in windows:
        start, end = w.start.hour * 60 + w.start.minute, w.end.hour * 60 + w.end.minute
        if start <= end:
            if today in w.days and start <= minute <= end:
                return True
        elif (today in w.days and minute >= start) or (yesterday in w.days and minute <= end):
            return True
    return False


def _running(wanted: list[str], programs: frozenset[str]) -> set[str]:
    """The wanted program names that run, case-insensitively, with or without ``.exe``."""
    def norm(name: str) -> str:
        name = name.lower()
        return name[:-4] if name.endswith(".exe") else name

    have = {norm(p) for p in programs}
    return {w for w in wanted if norm(w) in have}
