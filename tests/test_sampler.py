"""The sampler on this real machine: other programs' CPU (our own busy processes excluded), running
program names, idle time from the source, the GPU probe double, and idle sampling cost."""

from __future__ import annotations

import subprocess
import sys
import time

from dedloc_core.idle import NullIdle
from dedloc_core.sampler import FixedGpuProbe, GpuProbe, Sampler, gpu_probe

BURN = "import time\nend = time.time() + 30\nwhile time.time() < end: pass"


def test_other_cpu_counts_strangers_not_ours():
    ours = subprocess.Popen([sys.executable, "-c", BURN])
    try:
        sampler = Sampler(NullIdle(), FixedGpuProbe(), own_pids=lambda: [ours.pid], slow_period=0.0)
        sampler.sample()
        time.sleep(1.0)
        quiet = sampler.sample()
        stranger = subprocess.Popen([sys.executable, "-c", BURN])
        try:
            sampler.sample()
            time.sleep(1.0)
            busy = sampler.sample()
        finally:
            stranger.kill()
            stranger.wait()
    finally:
        ours.kill()
        ours.wait()
    one_core = 100.0 / sampler.threads
    assert busy.other_cpu_percent - quiet.other_cpu_percent > 0.5 * one_core, (quiet, busy)


def test_program_names_exclude_our_own():
    ours = subprocess.Popen(["sleep", "30"])
    sampler = Sampler(own_pids=lambda: [ours.pid], slow_period=0.0)
    try:
        assert "sleep" not in sampler.sample().programs
        stranger = subprocess.Popen(["sleep", "30"])
        try:
            assert "sleep" in sampler.sample().programs
        finally:
            stranger.kill()
            stranger.wait()
    finally:
        ours.kill()
        ours.wait()


def test_gpu_probe_double_and_default():
    assert Sampler(gpu=FixedGpuProbe(True), slow_period=0.0).sample().gpu_busy is True
    assert Sampler(gpu=FixedGpuProbe(False), slow_period=0.0).sample().gpu_busy is False
    probe = gpu_probe()  # NVML where a driver exists; "no GPU" here
    assert isinstance(probe, GpuProbe)
    assert probe.busy(set()) in (True, False)


def test_idle_sampling_is_cheap():
    sampler = Sampler(slow_period=60.0)
    sampler.sample()
    began = time.perf_counter()
    for _ in range(100):
        sampler.sample()
    assert (time.perf_counter() - began) / 100 < 0.005  # far below a 250 ms tick
