"""Robust aggregation of the parts this peer reduces in an all-reduce (hivemind's ``TensorPartReducer``,
patched by ``hivemind_ext.robust_reduce``), in sync and DiLoCo modes alike.

- A part with NaN or inf never enters the average: that sender is dropped from this round (its
  later parts too) and named in the log.
- ``centered_clip`` (Karimireddy et al. 2021, as in BTARD, Gorbunov et al. 2022): starting from the
  coordinate-wise median, ``iterations`` steps of ``v += sum_i w_i clip(x_i - v, tau) / sum_i w_i``,
  where ``clip`` scales a difference down to norm ``tau`` and ``tau`` is ``radius`` times the median
  distance of the parts from the median (so it follows the gradients' scale). ``mean`` is
  hivemind's weighted mean.
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

_settings = {"kind": "mean", "radius": 1.0, "iterations": 3}
_strikes: dict[str, list[float]] = {}  # per process: each averager counts what it saw


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
