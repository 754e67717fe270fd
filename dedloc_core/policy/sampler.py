"""Sampling the machine for the policy: idle time (every call, cheap), and every ``slow_period``
seconds battery, other programs' CPU, running program names (psutil) and GPU use by others (NVML).

Own processes (the app, the worker and its tree) are excluded from "other programs" through
``own_pids``, a callable that returns the current roots; their children are added here.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import psutil

from .idle import IdleSource, NullIdle

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    idle_seconds: float | None
    on_battery: bool
    other_cpu_percent: float
    gpu_busy: bool
    programs: frozenset[str]
    threads: int
    gpu_temp_c: float | None = None  # the hottest GPU, degrees Celsius


class GpuProbe:
    """Whether another process computes on the GPU now. The base class answers "no" (no GPU)."""

    name = "no GPU"

    def busy(self, own_pids: set[int]) -> bool:
        return False

    def temperature(self) -> float | None:
        """The hottest GPU's temperature in °C; None without a reading."""
        return None


class FixedGpuProbe(GpuProbe):
    """A test double: answers what it is told."""

    name = "fixed (test)"

    def __init__(self, busy: bool = False, temperature: float | None = None):
        self.value, self.temp = busy, temperature

    def busy(self, own_pids: set[int]) -> bool:
        return self.value

    def temperature(self) -> float | None:
        return self.temp


class NvmlGpuProbe(GpuProbe):
    """NVIDIA GPUs through NVML: busy when a process other than ours runs compute work on one."""

    name = "NVIDIA NVML"

    def __init__(self) -> None:
        import pynvml  # raises ImportError

        pynvml.nvmlInit()  # raises pynvml.NVMLError without a driver
        self._nvml = pynvml
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]

    def busy(self, own_pids: set[int]) -> bool:
        for handle in self._handles:
            try:
                procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except self._nvml.NVMLError:
                continue
            if any(p.pid not in own_pids for p in procs):
                return True
        return False

    def temperature(self) -> float | None:
        temps = []
        for handle in self._handles:
            try:
                temps.append(float(self._nvml.nvmlDeviceGetTemperature(handle, self._nvml.NVML_TEMPERATURE_GPU)))
            except self._nvml.NVMLError:
                continue
        return max(temps, default=None)


def gpu_probe() -> GpuProbe:
    """NVML where an NVIDIA driver answers, else a probe that always says "not busy"."""
    try:
        return NvmlGpuProbe()
    except Exception as exc:  # ImportError, NVMLError: no NVIDIA GPU here
        logger.info("No GPU probe: %s", exc)
        return GpuProbe()


class Sampler:
    def __init__(self, idle: IdleSource | None = None, gpu: GpuProbe | None = None, *,
                 own_pids: Callable[[], Iterable[int]] | None = None, slow_period: float = 2.0):
        self.idle = idle or NullIdle()
        self.gpu = gpu or GpuProbe()
        self.own_pids = own_pids or (lambda: [os.getpid()])
        self.slow_period = slow_period
        self.threads = psutil.cpu_count(logical=True) or 1
        self._procs: dict[int, psutil.Process] = {}
        self._slow: tuple[float, bool, float, bool, frozenset[str], float | None] | None = None
        self._cpu_times = psutil.cpu_times()

    def sample(self) -> Sample:
        now = time.monotonic()
        if self._slow is None or now - self._slow[0] >= self.slow_period:
            self._slow = (now, *self._sample_slow())
        _, battery, other_cpu, gpu_busy, programs, gpu_temp = self._slow
        return Sample(self._idle(), battery, other_cpu, gpu_busy, programs, self.threads, gpu_temp)

    def _idle(self) -> float | None:
        try:
            return self.idle.seconds()
        except Exception:  # a broken source counts as "cannot tell"
            logger.exception("Idle source %s failed", self.idle.name)
            return None

    def _total_cpu(self) -> float:
        """Percent of all cores busy since the last call (our own deltas: psutil.cpu_percent's are
        shared by every caller in the process)."""
        now, last = psutil.cpu_times(), self._cpu_times
        self._cpu_times = now
        idle = (now.idle + getattr(now, "iowait", 0.0)) - (last.idle + getattr(last, "iowait", 0.0))
        total = sum(now) - sum(last)
        return 0.0 if total <= 0 else max(0.0, min(100.0, 100.0 * (1.0 - idle / total)))

    def _own(self) -> set[int]:
        pids: set[int] = set()
        for pid in self.own_pids():
            pids.add(pid)
            try:
                pids.update(c.pid for c in psutil.Process(pid).children(recursive=True))
            except psutil.Error:
                continue
        return pids

    def _sample_slow(self) -> tuple[bool, float, bool, frozenset[str], float | None]:
        battery = psutil.sensors_battery() if hasattr(psutil, "sensors_battery") else None
        on_battery = battery is not None and battery.power_plugged is False
        own = self._own()
        total = self._total_cpu()
        mine = 0.0
        for pid in own:
            proc = self._procs.get(pid)
            try:
                if proc is None:
                    self._procs[pid] = proc = psutil.Process(pid)
                    proc.cpu_percent(None)  # first call starts its measurement
                else:
                    mine += proc.cpu_percent(None)  # percent of one core
            except psutil.Error:
                self._procs.pop(pid, None)
        for pid in set(self._procs) - own:
            del self._procs[pid]
        other = max(0.0, total - mine / self.threads)
        programs = set()
        for proc in psutil.process_iter(["name"]):
            if proc.pid not in own and proc.info["name"]:
                programs.add(proc.info["name"])
        try:
            gpu_busy, gpu_temp = self.gpu.busy(own), self.gpu.temperature()
        except Exception:  # a driver hiccup must not stop the policy loop
            logger.exception("GPU probe failed")
            gpu_busy, gpu_temp = False, None
        return on_battery, other, gpu_busy, frozenset(programs), gpu_temp
