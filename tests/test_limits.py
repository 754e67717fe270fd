"""The worker-side limits without a swarm: the pause gate stops a forward and a backward pass in
the middle, and the helpers that turn Limits into settings."""

from __future__ import annotations

import threading
import time

import torch

from dedloc_core.engine import bandwidth, limits
from dedloc_core.protocol import Limits


def test_gate_holds_inside_forward_and_backward():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    paused = threading.Event()
    where: list[str] = []

    def hold():
        where.append("hold")
        paused.clear()  # the user came back and left again: resume

    gate = limits.PauseGate(paused.is_set, hold)
    gate.attach(model)
    original = model[2].forward

    def second_layer(x):
        where.append("layer 2")
        return original(x)

    model[2].forward = second_layer
    model[0].register_forward_hook(lambda *_: paused.set())  # pause arrives after the first layer
    loss = model(torch.ones(2, 4)).sum()
    assert where[:2] == ["hold", "layer 2"]  # held before the second layer ran
    holds = gate.holds
    paused.set()
    loss.backward()  # the gradient hooks hold during backward
    assert gate.holds > holds and not paused.is_set()
    gate.detach()
    paused.set()
    model(torch.ones(2, 4))
    assert gate.holds == holds + 1


def test_limits_helpers():
    base = Limits(cpu_threads=2, upload_bps=1000, use_gpu=True)
    merged = limits.merged(base, Limits(upload_bps=0, gpu_memory_mb=512))
    assert merged == Limits(cpu_threads=2, upload_bps=0, use_gpu=True, gpu_memory_mb=512)
    assert limits.bandwidth_hint(Limits(upload_bps=250_000, download_bps=500_000)) == 250_000.0
    assert limits.bandwidth_hint(Limits(upload_bps=0)) is None
    assert limits.gpu_wanted(Limits(use_gpu=False)) is False
    threads = torch.get_num_threads()
    try:
        limits.apply_cpu_and_network(Limits(cpu_threads=1, upload_bps=123_000, download_bps=0))
        assert torch.get_num_threads() == 1
        assert bandwidth.caps() == (int(123_000 * limits.WIRE_SHARE), 0)  # headroom for headers
    finally:
        torch.set_num_threads(threads)
        bandwidth.set_caps(0, 0)
    limits.apply_gpu_memory_cap(Limits(gpu_memory_mb=256))  # no CUDA here: a no-op, not an error


def test_caps_change_as_set_limits_arrives_while_the_loop_is_busy():
    """The command reader applies new caps itself: a training loop blocked in a round (up to the
    averaging timeout) must not leave a newly capped peer uncapped until it looks again."""
    import functools
    import os

    from dedloc_core.engine.channel import Control, EventChannel, read_commands
    from dedloc_core.protocol import SetLimits, Stop, encode

    control = Control()
    control.on_limits = functools.partial(limits.apply_network_over, Limits(upload_bps=400_000))
    commands, events = os.pipe(), os.pipe()
    reader = threading.Thread(target=read_commands, args=(commands[0], control, EventChannel(events[1])), daemon=True)
    reader.start()
    bandwidth.set_caps(0, 0)
    try:
        os.write(commands[1], encode(SetLimits(limits=Limits(download_bps=200_000))).encode())
        deadline = time.monotonic() + 5
        while bandwidth.caps() == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        # nobody drained control.commands or looked at limits_changed: the reader did it
        assert bandwidth.caps() == (int(400_000 * limits.WIRE_SHARE), int(200_000 * limits.WIRE_SHARE))
        os.write(commands[1], encode(SetLimits(limits=Limits(upload_bps=0))).encode())
        deadline = time.monotonic() + 5
        while bandwidth.caps()[0] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bandwidth.caps() == (0, int(200_000 * limits.WIRE_SHARE))  # the earlier download cap stays
        os.write(commands[1], encode(Stop()).encode())
    finally:
        os.close(commands[1])  # end of input: the reader stops
        reader.join(5)
        bandwidth.set_caps(0, 0)
        for fd in (commands[0], *events):
            os.close(fd)
