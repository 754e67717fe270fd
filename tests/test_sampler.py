"""The sampler on this real machine: other programs' CPU (our own busy processes excluded), running
program names, idle time from the source, the GPU probe double, and idle sampling cost."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import psutil

from dedloc_core.policy.idle import NullIdle
from dedloc_core.policy.sampler import FixedGpuProbe, GpuProbe, Sampler, gpu_probe

BURN = "import time\nend = time.time() + 30\nwhile time.time() < end: pass"


def test_other_cpu_excludes_our_own_processes():
    burner = subprocess.Popen([sys.executable, "-c", BURN])
    try:
        mine = Sampler(NullIdle(), FixedGpuProbe(), own_pids=lambda: [burner.pid], slow_period=0.0)
        stranger = Sampler(NullIdle(), FixedGpuProbe(), own_pids=lambda: [], slow_period=0.0)
        reference = psutil.Process(burner.pid)
        mine.sample(), stranger.sample(), reference.cpu_percent(None)
        time.sleep(1.5)
        as_ours, as_other = mine.sample(), stranger.sample()
        burned = reference.cpu_percent(None) / mine.threads  # percent of all cores
    finally:
        burner.kill()
        burner.wait()
    assert burned > 10, "the burner got no CPU on this machine"
    # the same interval, seen with the burner as ours and as a stranger's: apart by what it burned
    assert abs((as_other.other_cpu_percent - as_ours.other_cpu_percent) - burned) < 0.4 * burned + 5, (
        as_ours.other_cpu_percent, as_other.other_cpu_percent, burned)


def test_program_names_exclude_our_own(tmp_path):
    program = tmp_path / f"dl4nap{os.getpid()}"[:15]  # a name no other process on this machine has
    shutil.copy(shutil.which("sleep"), program)
    ours = subprocess.Popen([str(program), "30"])
    sampler = Sampler(own_pids=lambda: [ours.pid], slow_period=0.0)
    try:
        assert program.name not in sampler.sample().programs
        stranger = subprocess.Popen([str(program), "30"])
        try:
            assert program.name in sampler.sample().programs
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
