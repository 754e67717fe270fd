"""Robust aggregation of the parts this peer reduces in an all-reduce (hivemind's ``TensorPartReducer``,
patched by ``hivemind_ext.robust_reduce``), in sync and DiLoCo modes alike.

- A part with NaN or inf never enters the average: that sender is dropped from this round (its
  later parts too) and named in the log.
- ``centered_clip`` (Karimireddy et al. 2021, as in BTARD, Gorbunov et al. 2022): starting from the
  coordinate-wise median, steps of ``v += sum_i w_i clip(x_i - v, tau) / sum_i w_i``, where
  ``clip`` scales a difference down to norm ``tau`` and ``tau`` is ``radius`` times the median
  distance of the parts from ``v`` (so it follows the gradients' scale), at least ``iterations``
  steps and on until a step is shorter than ``CONVERGED`` times ``tau``: at that fixed point the
  clipped differences sum to about zero, which is what a peer checks when it verifies a reducer
  (``hivemind_ext.verified_reduce``). ``mean`` is hivemind's weighted mean.
- A peer dropped ``STRIKES`` times within ``STRIKE_WINDOW`` seconds by one averager (strikes are
  counted per process), or caught in one offence that proves intent (``ban``: a wrong reduction,
  a failed check), is banned for ``BAN_SECONDS`` by the whole worker: left out of every averager's
  groups (as leader and follower) and state downloads. The ban list is shared by all the worker's
  processes, kept across restarts and reported to an invite-only experiment's backbone
  (``engine/bans.py``).

``configure`` is called in the worker before hivemind forks its averagers, which inherit it.
"""

from __future__ import annotations

import logging
import time

import torch

from . import bans

logger = logging.getLogger(__name__)

STRIKES = 3
STRIKE_WINDOW = 600.0
BAN_SECONDS = 600.0
CONVERGED = 0.005  # centered clip stops once a step is shorter than this times tau
MAX_ITERATIONS = 200

_settings = {"kind": "mean", "radius": 1.0, "iterations": 3, "verify": True}
_strikes: dict[str, list[float]] = {}  # per process: each averager counts what it saw


def configure(kind: str = "mean", radius: float = 1.0, iterations: int = 3, verify: bool = True) -> None:
    """Choose the aggregation (``mean`` or ``centered_clip``) for the all-reduces of this process (its
    averager threads) and of the averager processes it forks later. ``verify``: with ``centered_clip``,
    check every reducer's average before applying it (``hivemind_ext.verified_reduce``)."""
    if kind not in ("mean", "centered_clip"):
        raise ValueError(f"unknown aggregation {kind!r}")
    _settings.update(kind=kind, radius=float(radius), iterations=int(iterations), verify=bool(verify))


def kind() -> str:
    return str(_settings["kind"])


def verifying() -> bool:
    """Are reducers checked? Only with ``centered_clip``: with the mean any one part moves the
    average as far as it likes, so a reducer's lie cannot be told from its own part."""
    return _settings["kind"] == "centered_clip" and bool(_settings["verify"])


def finite(part: torch.Tensor) -> bool:
    return bool(torch.isfinite(part).all())


def radius() -> float:
    return float(_settings["radius"])


def aggregate(parts: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """The average a reducer returns for one part from its senders' ``parts``: the weighted mean or
    the centered clip, as configured."""
    if kind() == "centered_clip":
        return centered_clip(parts, weights)
    total = torch.zeros_like(parts[0], dtype=torch.float32)
    for part, weight in zip(parts, weights, strict=True):
        total.add_(part.float(), alpha=weight)
    return total.div_(sum(weights)).to(parts[0].dtype)


def clip_radius(distances: torch.Tensor) -> float:
    """``tau``: ``radius`` times the median of the parts' distances from the center (the lower
    middle for an even count, as ``torch.median``)."""
    return float(_settings["radius"]) * float(distances.median())


def centered_clip(parts: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """The centered-clip aggregate of ``parts`` (same shape), weighted, iterated to its fixed point."""
    stacked = torch.stack([p.float() for p in parts]).reshape(len(parts), -1)
    w = torch.tensor(weights, dtype=torch.float32).clamp_min(0)
    if float(w.sum()) <= 0:
        w = torch.ones_like(w)
    center = stacked.median(dim=0).values
    for done in range(MAX_ITERATIONS):
        diff = stacked - center
        distances = diff.norm(dim=1)
        tau = clip_radius(distances)
        if tau <= 0:
            break
        scale = (tau / distances.clamp_min(1e-12)).clamp(max=1.0)
        step = (diff * (scale * w).unsqueeze(1)).sum(0) / w.sum()
        center = center + step
        if done + 1 >= int(_settings["iterations"]) and float(step.norm()) <= CONVERGED * tau:
            break
    return center.reshape(parts[0].shape).to(parts[0].dtype)


def strike(peer: str, reason: str = "dropped parts", now: float | None = None) -> bool:
    """Count a dropped part of ``peer`` (wall clock ``now``); True when that makes it banned."""
    now = time.time() if now is None else now
    recent = [t for t in _strikes.get(peer, []) if now - t < STRIKE_WINDOW] + [now]
    _strikes[peer] = recent
    if len(recent) >= STRIKES:
        _strikes[peer] = []
        return ban(peer, f"{reason} ({len(recent)} times)", now=now)
    return False


def ban(peer: str, reason: str, seconds: float | None = None, now: float | None = None) -> bool:
    """Ban ``peer`` from every averager of this worker for ``seconds`` (default ``BAN_SECONDS``)."""
    seconds = BAN_SECONDS if seconds is None else seconds
    if not bans.ban(peer, reason, seconds, now):
        return False
    logger.warning("Banned %s from averaging for %.0f s: %s", peer, seconds, reason)
    return True


def banned(peer: str, now: float | None = None) -> bool:
    return bans.banned(peer, now)
