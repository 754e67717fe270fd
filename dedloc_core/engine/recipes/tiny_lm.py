"""``tiny-lm``: a small GPT-style causal transformer over bytes, trained on the shipped corpus.

Pre-LN blocks, learned positional embeddings, input and output embeddings tied, attention by
``F.scaled_dot_product_attention(is_causal=True)``. With no shard paths given, training and
evaluation use the corpus in ``resources/corpus``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dedloc_core.catalog.recipes import TinyLMParams

from .text import BYTE_VOCAB, TextSource, TextWindows, corpus_eval, corpus_shards, eval_windows

EVAL_BATCH = 16


class Block(nn.Module):
    """One pre-LN transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads, self.dropout = n_heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            is_causal=True, dropout_p=self.dropout if self.training else 0.0,
        )  # fmt: skip
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyLM(nn.Module):
    """Byte-level causal language model; ``forward`` maps ``[B, T]`` ids to ``[B, T, 256]`` logits."""

    def __init__(self, p: TinyLMParams):
        super().__init__()
        self.tok = nn.Embedding(BYTE_VOCAB, p.d_model)
        self.pos = nn.Embedding(p.seq_len, p.d_model)
        self.drop = nn.Dropout(p.dropout)
        self.blocks = nn.ModuleList(Block(p.d_model, p.n_heads, p.dropout) for _ in range(p.n_layers))
        self.ln_f = nn.LayerNorm(p.d_model)
        self.apply(self._init)
        for block in self.blocks:  # GPT-2: scale residual projections by depth
            for layer in (block.proj, block.mlp[2]):
                nn.init.normal_(layer.weight, std=0.02 / math.sqrt(2 * p.n_layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.tok(ids) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok.weight.T  # tied output embedding


class WarmupConstant:
    """LR factor for ``LambdaLR``: linear warmup over ``steps`` global steps, then 1 (picklable)."""

    def __init__(self, steps: int):
        self.steps = steps

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / (self.steps + 1))


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter."""
    return next(model.parameters()).device


class TinyLMRecipe:
    """The ``tiny-lm`` recipe (see ``dedloc_core.engine.recipes.base.Recipe``)."""

    name = "tiny-lm"

    def __init__(self, params: TinyLMParams):
        self.params = params

    def build_model(self, seed: int = 0) -> TinyLM:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return TinyLM(self.params)

    def build_optimizer(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        p = self.params
        return torch.optim.AdamW(params, lr=p.lr, weight_decay=p.weight_decay, betas=(0.9, 0.95))

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupConstant(self.params.warmup_steps))

    def batches(
        self, shard_paths: Sequence[TextSource], batch_size: int, seed: int
    ) -> Iterator[torch.Tensor]:
        """Endless ``[batch_size, seq_len + 1]`` byte windows (the shipped corpus if no paths)."""
        return TextWindows(shard_paths or corpus_shards(), self.params.seq_len, seed).batches(batch_size)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        batch = batch.to(model_device(model))
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    def evaluate(self, model: nn.Module, shard_paths: Sequence[TextSource], max_batches: int = 8) -> float:
        """Mean loss over fixed windows of ``shard_paths`` (the shipped ``eval.txt`` if none)."""
        windows = eval_windows(shard_paths or corpus_eval(), self.params.seq_len, max_batches * EVAL_BATCH)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                losses = [self.loss(model, chunk).item() for chunk in windows.split(EVAL_BATCH)]
        finally:
            model.train(was_training)
        return sum(losses) / len(losses)


def build(params: TinyLMParams) -> TinyLMRecipe:
    """The ``tiny-lm`` recipe with ``params``."""
    return TinyLMRecipe(params)
