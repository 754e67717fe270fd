"""The step watch: while the training loop is blocked in ``opt.step()`` (an averaging round), a
pause and a resume from the app are reported at once, not when the step ends."""

from __future__ import annotations

import time

import pytest

from dedloc_core.engine.channel import Control
from dedloc_core.engine.training import StepWatch
from dedloc_core.protocol import Pause, Resume

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast


def wait_for(said: list[str], count: int, timeout: float = 2.0) -> float:
    """Seconds until ``said`` holds ``count`` reports."""
    began = time.monotonic()
    while len(said) < count and time.monotonic() - began < timeout:
        time.sleep(0.005)
    assert len(said) >= count, f"the watch said only {said}"
    return time.monotonic() - began


def test_pause_and_resume_inside_a_blocked_step_are_said_at_once():
    control, said = Control(), []
    watch = StepWatch(control, lambda: said.append("paused"), lambda: said.append("training"))
    try:
        with watch:  # a step blocked in a round
            time.sleep(0.2)
            control.apply(Pause(reason="user"))
            assert wait_for(said, 1) < 0.5 and said == ["paused"]
            control.apply(Resume())
            assert wait_for(said, 2) < 0.5
        assert said == ["paused", "training"]
        assert watch.take() is False  # it last said "training": the loop goes on
        with watch:  # the next step: paused, and still paused when the step ends
            control.apply(Pause(reason="user"))
            wait_for(said, 3)
        assert said[2] == "paused" and watch.take() is True  # the loop holds now
        assert watch.take() is False  # told once
    finally:
        watch.close()


def test_a_step_shorter_than_the_grace_says_nothing():
    control, said = Control(), []
    control.apply(Pause(reason="user"))
    watch = StepWatch(control, lambda: said.append("paused"), lambda: said.append("training"), grace=0.5)
    try:
        with watch:
            time.sleep(0.05)
        time.sleep(0.6)
        assert said == [] and watch.take() is False
    finally:
        watch.close()
