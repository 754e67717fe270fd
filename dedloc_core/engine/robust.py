"""Robust aggregation of the parts this peer reduces in an all-reduce (hivemind's ``TensorPartReducer``,
patched by ``hivemind_ext.robust_reduce``), in sync and DiLoCo modes alike.

- A part with NaN or inf never enters the average: that sender is dropped from this round (its
  later parts too) and named in the log.
- ``centered_clip`` (Karimireddy et al. 2021, as in BTARD, Gorbunov et al. 2022): starting from the
  coordinate-wise median, ``iterations`` steps of ``v += sum_i w_i clip(x_i - v, tau) / sum_i w_i``,
  where ``clip`` scales a difference down to norm ``tau`` and ``tau`` is ``radius`` times the median
  distance of the parts from the median (so it follows the gradients' scale). ``mean`` is
  hivemind's weighted mean.
- A peer dropped ``STRIKES`` times within ``STRIKE_WINDOW`` seconds is left out of this peer's
  groups (matchmaking, both as leader and follower) for ``BAN_SECONDS``.

``configure`` is called in the worker before hivemind forks its averagers, which inherit it.
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)

STRIKES = 3
STRIKE_WINDOW = 600.0
BAN_SECONDS = 600.0

_settings = {"kind": "mean", "radius": 1.0, "iterations": 3}
_strikes: dict[str, list[float]] = {}
_banned_until: dict[str, float] = {}


def configure(kind: str = "mean", radius: float = 1.0, iterations: int = 3) -> None:
    """Choose the aggregation (``mean`` or ``centered_clip``) for the all-reduces of this process (its
    averager threads) and of the averager processes it forks later."""
    if kind not in ("mean", "centered_clip"):
        raise ValueError(f"unknown aggregation {kind!r}")
    _settings.update(kind=kind, radius=float(radius), iterations=int(iterations))


def kind() -> str:
    return str(_settings["kind"])


def finite(part: torch.Tensor) -> bool:
    return bool(torch.isfinite(part).all())


def centered_clip(parts: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """The centered-clip aggregate of ``parts`` (same shape), weighted."""
    stacked = torch.stack([p.float() for p in parts])
    w = torch.tensor(weights, dtype=torch.float32).clamp_min(0)
    if float(w.sum()) <= 0:
        w = torch.ones_like(w)
    center = stacked.median(dim=0).values
    flat = (stacked - center).reshape(len(parts), -1)
    tau = float(_settings["radius"]) * float(flat.norm(dim=1).median())
    if tau <= 0:
        return center.to(parts[0].dtype)
    for _ in range(int(_settings["iterations"])):
        diff = (stacked - center).reshape(len(parts), -1)
        scale = (tau / diff.norm(dim=1).clamp_min(1e-12)).clamp(max=1.0)
        step = (diff * (scale * w).unsqueeze(1)).sum(0) / w.sum()
        center = center + step.reshape(center.shape)
    return center.to(parts[0].dtype)


def strike(peer: str, now: float | None = None) -> bool:
    """Count a dropped part of ``peer``; True when that makes it banned for a while."""
    now = time.monotonic() if now is None else now
    recent = [t for t in _strikes.get(peer, []) if now - t < STRIKE_WINDOW] + [now]
    _strikes[peer] = recent
    if len(recent) >= STRIKES:
        _banned_until[peer] = now + BAN_SECONDS
        _strikes[peer] = []
        logger.warning("Leaving %s out of averaging groups for %.0f s: its parts were dropped %d times",
                       peer, BAN_SECONDS, len(recent))
        return True
    return False


def banned(peer: str, now: float | None = None) -> bool:
    now = time.monotonic() if now is None else now
    return _banned_until.get(peer, 0.0) > now
