"""Pacing a sync-mode swarm: a global step long enough to hide an averaging round.

With overlap (``SwarmConfig.overlap``), a step's gradient all-reduce runs while the next step
accumulates; the training loop waits only when a round outlasts a step. So a step (target batch /
the swarm's samples/s) must last ``headroom`` times a round, and matchmaking, which hivemind starts
``matchmaking_time`` before the step's estimated end, must fit well inside a step too. Pure Python;
``bench/swarm_netlab.py`` paces its experiment with it from measured throughput (the product's
experiments take their target batch from the catalog).

``headroom`` 4 by default: at 2, in the network lab, the volunteers left part of their CPU quota
idle, waiting for rounds that outlasted the estimate (``bench/swarm_netlab.py --headroom 2`` shows
it). The price is a target batch twice as large: half the optimizer steps per sample
(large-batch training is DeDLOC's premise; its runs stepped every few minutes).

``quiet`` says when in a step a large transfer that is not a round (the backbone loading the whole
state from a volunteer) disturbs none: the last step's rounds run in its first part, the next
step's matchmaking in its last quarter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Pace", "pace", "quiet", "round_seconds"]


@dataclass(frozen=True)
class Pace:
    target_batch_size: int
    matchmaking_time: float
    step_seconds: float  # the step's expected duration at the measured throughput


def round_seconds(param_count: int, slowest_mbit: float, rtt_seconds: float, *, value_bytes: float = 2.0,
                  all_reduces: int = 2, trips: int = 8) -> float:
    """An upper estimate of one step's averaging time: ``all_reduces`` butterfly all-reduces (the
    gradients, then the parameters) of ``param_count`` values of ``value_bytes`` each; every peer
    sends and receives at most the whole vector twice (its part's inputs out, the averaged parts
    in), over the slowest link, plus ``trips`` round trips of matchmaking and handshakes."""
    if param_count <= 0 or slowest_mbit <= 0:
        raise ValueError("param_count and slowest_mbit must be positive")
    transfer = all_reduces * 2 * param_count * value_bytes * 8 / (slowest_mbit * 1e6)
    return transfer + trips * rtt_seconds


def pace(samples_per_second: float, round_s: float, *, headroom: float = 4.0, min_batch: int = 1,
         multiple: int = 1, min_matchmaking: float = 1.0, max_matchmaking: float = 15.0) -> Pace:
    """The target batch (a multiple of ``multiple``, at least ``min_batch``) whose step lasts
    ``headroom`` x ``round_s`` at ``samples_per_second``, and a matchmaking time of a quarter of that
    step (at least ``min_matchmaking``: peers far apart need a few round trips to form a group; at
    most ``max_matchmaking``, hivemind's default for swarms over the internet)."""
    if samples_per_second <= 0 or round_s <= 0 or headroom <= 0:
        raise ValueError("samples_per_second, round_s and headroom must be positive")
    step = headroom * round_s
    batch = max(min_batch, multiple * math.ceil(samples_per_second * step / multiple))
    step = batch / samples_per_second
    return Pace(batch, round(min(max_matchmaking, max(min_matchmaking, step / 4)), 2), step)


QUIET = (0.3, 0.7)  # the part of a step (by its time left) with no round of ours


def quiet(seconds_left: float, step_seconds: float, window: tuple[float, float] = QUIET) -> bool:
    """Whether a step with ``seconds_left`` of its ``step_seconds`` to go is in its quiet part: the
    rounds of the step before (with overlap they run while this one accumulates, and a parameter
    round follows the step) are over, and matchmaking for this step's round (``pace``: a quarter of
    the step before its estimated end) has not begun. False when either figure is unknown."""
    if not (math.isfinite(seconds_left) and math.isfinite(step_seconds)) or step_seconds <= 0:
        return False
    low, high = window
    return low * step_seconds <= seconds_left <= high * step_seconds
