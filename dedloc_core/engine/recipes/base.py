"""The interface every recipe implements."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch


class Recipe(Protocol):
    name: str

    def build_model(self, seed: int = 0) -> torch.nn.Module:
        """A freshly initialized model; the same seed gives the same weights."""

    def build_optimizer(self, params) -> torch.optim.Optimizer:
        """The local optimizer that hivemind wraps (e.g. AdamW with the recipe's lr)."""

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        """An LR scheduler stepped once per global step, or None."""

    def batches(self, shard_paths: Sequence[Path], batch_size: int, seed: int) -> Iterator[Any]:
        """An endless stream of training micro-batches of ``batch_size`` samples."""

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The training loss of one micro-batch."""

    def evaluate(self, model: torch.nn.Module, shard_paths: Sequence[Path], max_batches: int = 8) -> float:
        """Mean loss on a fixed held-out slice of the data (deterministic)."""
