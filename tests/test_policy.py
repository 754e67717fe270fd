"""The contribution policy (a pure function), table-driven over every input, and the Contributor
that turns decisions into worker actions (fake clock, a sampler with a scripted idle source)."""

from __future__ import annotations

from datetime import datetime, time, timedelta

import pytest
from msgspec.structs import replace

from dedloc_core.policy.contributor import Contributor, Pause, ReleaseWorker, Resume, SetLimits, StartWorker
from dedloc_core.policy.idle import IdleSource
from dedloc_core.policy.rules import Inputs, decide, in_schedule
from dedloc_core.policy.sampler import FixedGpuProbe, Sampler
from dedloc_core.prefs import Preferences, TimeWindow

MON_14H = datetime(2026, 11, 23, 14, 0)  # a Monday
AWAY = 3600.0  # idle seconds: the user is away
HERE = 5.0

P = Preferences()  # defaults: idle only, 3 min, no battery, other CPU 50 %, GPU off while in use
NIGHTS = [TimeWindow(days=(0, 1, 2, 3, 4), start=time(22, 0), end=time(6, 30))]

# (name, inputs, prefs, run, words expected in the reason)
CASES = [
    ("away: run", dict(idle_seconds=AWAY), P, True, "Contributing"),
    ("present: pause", dict(idle_seconds=HERE), P, False, "using the computer"),
    ("just under N minutes: in use", dict(idle_seconds=179), P, False, "using"),
    ("N minutes: away", dict(idle_seconds=180), P, True, "Contributing"),
    ("idle N from prefs", dict(idle_seconds=400), replace(P, idle_minutes=10), False, "using"),
    ("present, not idle-only: run", dict(idle_seconds=HERE), replace(P, idle_only=False), True,
     "you are using the computer: 25% CPU"),
    ("no idle source: schedule only", dict(idle_seconds=None), P, True, "no idle detection"),
    ("no idle source, outside schedule", dict(idle_seconds=None), replace(P, schedule=NIGHTS),
     False, "Outside your schedule"),
    ("user pause", dict(idle_seconds=AWAY, user_paused=True), P, False, "Paused by you"),
    ("snoozed", dict(idle_seconds=AWAY, snoozed_until=MON_14H + timedelta(hours=1)), P, False,
     "Snoozed until 15:00"),
    ("snooze over", dict(idle_seconds=AWAY, snoozed_until=MON_14H - timedelta(seconds=1)), P, True, "Contributing"),
    ("on battery", dict(idle_seconds=AWAY, on_battery=True), P, False, "battery"),
    ("on battery allowed", dict(idle_seconds=AWAY, on_battery=True), replace(P, run_on_battery=True),
     True, "Contributing"),
    ("outside schedule", dict(idle_seconds=AWAY), replace(P, schedule=NIGHTS), False,
     "Mon, Tue, Wed, Thu, Fri 22:00-06:30"),
    ("inside schedule (overnight)", dict(idle_seconds=AWAY, now=datetime(2026, 11, 24, 3, 0)),
     replace(P, schedule=NIGHTS), True, "Contributing"),
    ("Saturday night after Friday's window", dict(idle_seconds=AWAY, now=datetime(2026, 11, 28, 6, 0)),
     replace(P, schedule=NIGHTS), True, "Contributing"),
    ("Sunday night: no window", dict(idle_seconds=AWAY, now=datetime(2026, 11, 29, 23, 0)),
     replace(P, schedule=NIGHTS), False, "Outside"),
    ("other programs' CPU", dict(idle_seconds=AWAY, other_cpu_percent=73.4), P, False, "Other programs use 73%"),
    ("other CPU under the limit", dict(idle_seconds=AWAY, other_cpu_percent=40), P, True, "Contributing"),
    ("other CPU check off", dict(idle_seconds=AWAY, other_cpu_percent=99),
     replace(P, other_cpu_limit=None), True, "Contributing"),
    ("a game runs", dict(idle_seconds=AWAY, programs=frozenset({"bash", "Game.EXE"})),
     replace(P, blocking_programs=["game"]), False, "game is running"),
    ("another program runs", dict(idle_seconds=AWAY, programs=frozenset({"bash"})),
     replace(P, blocking_programs=["game"]), True, "Contributing"),
    ("GPU used by another program", dict(idle_seconds=AWAY, gpu_busy=True), P, True, "GPU left to another program"),
    ("GPU snoozed", dict(idle_seconds=AWAY, gpu_snoozed_until=MON_14H + timedelta(minutes=30)), P, True,
     "GPU snoozed until 14:30"),
    ("quota used", dict(idle_seconds=AWAY, quota_used=True), replace(P, daily_quota_mb=100), False,
     "quota (100 MB)"),
    ("pause beats everything", dict(idle_seconds=AWAY, user_paused=True, on_battery=True, quota_used=True), P,
     False, "Paused by you"),
]


@pytest.mark.parametrize("name,given,prefs,run,words", CASES, ids=[c[0] for c in CASES])
def test_decide(name, given, prefs, run, words):
    decision = decide(Inputs(**{"now": MON_14H, "threads": 8, **given}), prefs)
    assert decision.run is run, decision
    assert words in decision.reason


# (name, inputs, prefs, expected limits fields)
LIMIT_CASES = [
    ("away: idle share, GPU on", dict(idle_seconds=AWAY), P, dict(cpu_threads=8, use_gpu=True)),
    ("in use: in-use share, GPU off", dict(idle_seconds=HERE), replace(P, idle_only=False),
     dict(cpu_threads=2, use_gpu=False)),
    ("in use, GPU allowed while in use", dict(idle_seconds=HERE),
     replace(P, idle_only=False, gpu_while_in_use=True), dict(use_gpu=True)),
    ("GPU off in prefs", dict(idle_seconds=AWAY), replace(P, use_gpu=False), dict(use_gpu=False)),
    ("GPU busy", dict(idle_seconds=AWAY, gpu_busy=True), P, dict(use_gpu=False)),
    ("GPU snoozed", dict(idle_seconds=AWAY, gpu_snoozed_until=MON_14H + timedelta(minutes=1)), P,
     dict(use_gpu=False)),
    ("caps", dict(idle_seconds=AWAY), replace(P, upload_cap_kbs=250, download_cap_kbs=500,
                                                           gpu_memory_cap_mb=2048),
     dict(upload_bps=250_000, download_bps=500_000, gpu_memory_mb=2048)),
    ("no caps: 0", dict(idle_seconds=AWAY), P, dict(upload_bps=0, download_bps=0, gpu_memory_mb=0)),
    ("one thread at least", dict(idle_seconds=HERE, threads=1), replace(P, idle_only=False),
     dict(cpu_threads=1)),
    ("share of 6 threads", dict(idle_seconds=AWAY, threads=6), replace(P, cpu_share_idle=50),
     dict(cpu_threads=3)),
]


@pytest.mark.parametrize("name,given,prefs,expected", LIMIT_CASES, ids=[c[0] for c in LIMIT_CASES])
def test_limits(name, given, prefs, expected):
    limits = decide(Inputs(**{"now": MON_14H, "threads": 8, **given}), prefs).limits
    for key, value in expected.items():
        assert getattr(limits, key) == value, (key, limits)


def test_schedule_edges():
    window = [TimeWindow(days=(0,), start=time(9, 0), end=time(17, 0))]
    assert in_schedule(window, datetime(2026, 11, 23, 9, 0))
    assert in_schedule(window, datetime(2026, 11, 23, 17, 0, 59))
    assert not in_schedule(window, datetime(2026, 11, 23, 17, 1))
    assert not in_schedule(window, datetime(2026, 11, 24, 12, 0))  # Tuesday


# ---- Contributor ----------------------------------------------------------------------------


class ScriptedIdle(IdleSource):
    name = "scripted"

    def __init__(self, value: float | None = AWAY):
        self.value = value

    def seconds(self) -> float | None:
        return self.value


class Clock:
    def __init__(self):
        self.wall = MON_14H
        self.mono = 1000.0

    def advance(self, seconds: float) -> None:
        self.wall += timedelta(seconds=seconds)
        self.mono += seconds


def contributor(prefs: Preferences = P, idle_value: float | None = AWAY, gpu_busy: bool = False):
    clock = Clock()
    source = ScriptedIdle(idle_value)
    gpu = FixedGpuProbe(gpu_busy)
    c = Contributor(replace(prefs, other_cpu_limit=None), Sampler(source, gpu, slow_period=0.0),
                    clock=lambda: clock.wall, monotonic=lambda: clock.mono)
    return c, clock, source, gpu


def test_contributor_starts_pauses_resumes():
    c, clock, source, _ = contributor()
    (start,) = c.tick()
    assert isinstance(start, StartWorker) and start.limits.use_gpu
    assert c.tick() == []  # nothing changed
    source.value = 1.0  # the user is back
    assert c.tick() == [Pause("You are using the computer")]
    assert c.decision.reason == "You are using the computer"
    assert c.tick() == []
    source.value = AWAY
    assert c.tick() == [Resume()]
    c.pause()
    assert c.tick() == [Pause("Paused by you")]
    c.resume()
    assert c.tick() == [Resume()]


def test_contributor_limits_follow_the_user():
    c, clock, source, gpu = contributor(replace(P, idle_only=False))
    c.tick()
    source.value = 1.0
    (change,) = c.tick()
    assert isinstance(change, SetLimits) and change.limits.use_gpu is False
    source.value = AWAY
    gpu.value = True  # another program takes the GPU
    (change,) = c.tick()
    assert isinstance(change, SetLimits) and change.limits.use_gpu is False and change.limits.cpu_threads > 1
    assert "GPU left to another program" in c.decision.reason


def test_long_pause_releases_the_worker_and_resume_restarts_it():
    c, clock, source, _ = contributor(replace(P, long_pause_minutes=10))
    c.tick()
    source.value = 0.0
    assert isinstance(c.tick()[0], Pause)
    clock.advance(9 * 60)
    assert c.tick() == []
    clock.advance(61)
    assert c.tick() == [ReleaseWorker("You are using the computer")]
    assert c.worker == "released"
    assert c.tick() == []
    source.value = AWAY
    (start,) = c.tick()
    assert isinstance(start, StartWorker)


def test_snooze_and_gpu_snooze():
    c, clock, source, _ = contributor()
    c.tick()
    c.snooze(3600, gpu_only=True)
    (change,) = c.tick()
    assert isinstance(change, SetLimits) and change.limits.use_gpu is False
    c.snooze(600)
    assert c.tick() == [Pause("Snoozed until 14:10")]
    clock.advance(601)
    assert c.tick() == [Resume()]
    assert "GPU snoozed until 15:00" in c.decision.reason


def test_daily_quota_pauses_until_midnight():
    c, clock, source, _ = contributor(replace(P, daily_quota_mb=10))
    c.tick()
    c.on_stats(3_000_000, 3_000_000)
    assert c.tick() == []
    c.on_stats(5_000_000, 5_000_001)  # 10 MB + 1 byte today
    assert c.tick() == [Pause("Today's transfer quota (10 MB) is used up; resuming at midnight")]
    c.worker_released()  # a restarted worker counts from 0 again: today's total stays
    c.on_stats(100, 100)
    assert c.bytes_today == 10_000_201
    assert c.tick() == []
    clock.advance(10 * 3600 + 1)  # past midnight
    assert isinstance(c.tick()[0], StartWorker)


def test_unknown_idle_counts_as_present():
    c, clock, source, _ = contributor(idle_value=None)
    (start,) = c.tick()
    assert isinstance(start, StartWorker)
    assert start.limits.cpu_threads == max(1, round(c.sampler.threads * 25 / 100))
    assert start.limits.use_gpu is False


def test_gpu_temperature_cap_with_hysteresis():
    """Pure: at or above the limit the GPU goes off; it comes back only 5 °C below it."""
    def use_gpu(temp, cooling, prefs=P):
        d = decide(Inputs(now=MON_14H, threads=8, idle_seconds=AWAY, gpu_temp_c=temp, gpu_cooling=cooling), prefs)
        assert d.run  # the CPU goes on working
        return d.limits.use_gpu, d.gpu_hot

    assert P.gpu_temp_limit_c == 83
    assert use_gpu(82.0, False) == (True, False)
    assert use_gpu(83.0, False) == (False, True)
    assert use_gpu(80.0, True) == (False, True)  # cooling: still above 78
    assert use_gpu(78.0, True) == (True, False)
    assert use_gpu(None, True) == (True, False)  # no reading: nothing to go by
    assert use_gpu(95.0, False, replace(P, gpu_temp_limit_c=None)) == (True, False)  # no cap


def test_contributor_carries_the_gpu_heat_between_ticks():
    c, clock, source, gpu = contributor()
    gpu.temp = 70.0
    (start,) = c.tick()
    assert start.limits.use_gpu
    gpu.temp = 85.0
    (change,) = c.tick()
    assert isinstance(change, SetLimits) and change.limits.use_gpu is False
    assert "GPU at 85 °C: off until 78 °C" in c.decision.reason
    gpu.temp = 80.0
    assert c.tick() == []  # between the limits: stays off
    gpu.temp = 77.0
    (change,) = c.tick()
    assert isinstance(change, SetLimits) and change.limits.use_gpu is True
    gpu.temp = 80.0
    assert c.tick() == []  # warming again, under the limit: stays on
