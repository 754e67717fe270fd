"""Pacing a sync-mode swarm (engine/pacing.py): a step long enough to hide a round."""

from __future__ import annotations

import pytest

from dedloc_core.engine.pacing import pace, quiet, round_seconds


def test_a_paced_step_lasts_headroom_times_the_round():
    p = pace(1000.0, 2.0, headroom=2.0, multiple=64)
    assert p.target_batch_size % 64 == 0
    assert 4.0 <= p.step_seconds < 4.0 + 64 / 1000
    assert p.target_batch_size == 4032
    assert p.matchmaking_time == pytest.approx(p.step_seconds / 4, abs=0.01)


def test_a_slow_swarm_keeps_the_minimums():
    p = pace(10.0, 0.1, min_batch=256, min_matchmaking=1.0)
    assert p.target_batch_size == 256 and p.step_seconds == pytest.approx(25.6) and p.matchmaking_time == 6.4
    assert pace(1000.0, 0.1).matchmaking_time == 1.0  # a quarter of 0.2 s is too short to meet
    assert pace(10.0, 100.0).matchmaking_time == 15.0


def test_the_round_estimate_grows_with_the_model_and_shrinks_with_the_link():
    base = round_seconds(400_000, 20, 0.1)
    # fp16 gradients and parameters, twice each way: 400k x 2 B x 2 x 2 x 8 bit / 20 Mbit/s = 1.28 s
    assert base == pytest.approx(1.28 + 0.8)
    assert round_seconds(800_000, 20, 0.1) > base > round_seconds(400_000, 100, 0.1)


@pytest.mark.parametrize("args", [(0, 1.0), (100.0, 0), (-1, 1.0)])
def test_impossible_inputs_are_clear_errors(args):
    with pytest.raises(ValueError, match="positive"):
        pace(*args)
    with pytest.raises(ValueError, match="positive"):
        round_seconds(0, 20, 0.1)


def test_the_quiet_part_of_a_step_is_away_from_its_rounds():
    step = pace(1000.0, 2.0, headroom=4.0)  # 8 s a step, matchmaking from 2 s before its end
    assert not quiet(7.5, step.step_seconds)  # the last step's rounds are still running
    assert quiet(5.0, step.step_seconds) and quiet(3.0, step.step_seconds)
    assert not quiet(step.matchmaking_time, step.step_seconds)  # this step's matchmaking has begun
    assert not quiet(0.0, step.step_seconds)
    # nothing known about the swarm (no peers: its ETA and step are infinite) is never quiet
    assert not quiet(float("inf"), 8.0) and not quiet(4.0, float("inf")) and not quiet(4.0, 0.0)
