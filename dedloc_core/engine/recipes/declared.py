"""``causal-lm`` and ``masked-lm``: a transformers model built from the catalog's declared config
(``dedloc_core.catalog.declared``), trained on token shards.

The model is built from its config class alone (random weights): no download, no remote code. Token
shards are numpy ``.npy`` arrays ``[rows, seq_len]`` of token ids (``dedloc data prepare`` writes
them); a causal row is its own labels (the model shifts them), a masked row is ``[CLS] ... [SEP]``
and gets BERT's masking here. The optimizer is AdamW or LAMB with clipping and the declared schedule.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from dedloc_core.catalog import declared
from dedloc_core.errors import RecipeError, ShardError

from .tiny_lm import model_device

EVAL_BATCH = 16
EVAL_MASK_SEED = 0
# ids of the special tokens that ``dedloc data prepare`` gives a masked-LM tokenizer, used when the
# experiment names no tokenizer
MASKED_SPECIALS = {"pad": "[PAD]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
DEFAULT_MASKED_IDS = {"pad": 0, "cls": 2, "sep": 3, "mask": 4}
_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "albert": ("AlbertConfig", "AlbertForMaskedLM"),
    "bert": ("BertConfig", "BertForMaskedLM"),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM"),
}
# each masked-LM class's encoder and vocabulary head (attribute names)
_MLM_PARTS = {"albert": ("albert", "predictions"), "bert": ("bert", "cls"), "roberta": ("roberta", "lm_head")}
_BAD_DATA = "The experiment's data does not match its model: tell its organizer."


class MLMBatch(NamedTuple):
    input_ids: torch.Tensor
    labels: torch.Tensor


class Schedule:
    """LR factor for ``LambdaLR``: linear warm-up over ``warmup`` global steps, then constant, linear
    or cosine decay to ``low`` at ``total`` (picklable)."""

    def __init__(self, warmup: int, decay: str, total: int, low: float):
        self.warmup, self.decay, self.total, self.low = warmup, decay, total, low

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        if self.decay == "constant":
            return 1.0
        done = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        shape = 1.0 - done if self.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
        return self.low + (1.0 - self.low) * shape


def _clip(optimizer: torch.optim.Optimizer, max_norm: float | None) -> None:
    if max_norm:
        grads = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(grads, max_norm)


class ClippedAdamW(torch.optim.AdamW):
    """AdamW that clips the gradients' global norm to ``max_grad_norm`` before each step."""

    def __init__(self, params, max_grad_norm: float | None = None, **kwargs):
        super().__init__(params, **kwargs)
        self.max_grad_norm = max_grad_norm

    def step(self, closure=None):
        _clip(self, self.max_grad_norm)
        return super().step(closure)


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2020), DeDLOC's optimizer for ALBERT: Adam's update with decoupled weight
    decay, scaled per tensor by the trust ratio ||w|| / ||update|| (at most ``clamp``). Its state is
    Adam's (``step``, ``exp_avg``, ``exp_avg_sq``), so hivemind averages and shares it the same way."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0,
                 max_grad_norm: float | None = None, clamp: float = 10.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, clamp=clamp))
        self.max_grad_norm = max_grad_norm

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        _clip(self, self.max_grad_norm)
        for group in self.param_groups:
            (b1, b2), eps, decay = group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = float(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = (m / (1 - b1**t)) / (v / (1 - b2**t)).sqrt().add_(eps)
                if decay:
                    update.add_(p, alpha=decay)
                w, u = float(p.norm()), float(update.norm())
                trust = min(w / u, group["clamp"]) if w > 0 and u > 0 else 1.0
                p.add_(update, alpha=-group["lr"] * trust)
        return loss


def special_ids(tok) -> dict[str, int]:
    """A masked LM's special token ids from its tokenizer (the prepare tool's without one)."""
    if tok is None:
        return dict(DEFAULT_MASKED_IDS)
    ids = {k: tok.token_to_id(token) for k, token in MASKED_SPECIALS.items()}
    missing = [MASKED_SPECIALS[k] for k, v in ids.items() if v is None]
    if missing:
        raise RecipeError(f"The experiment's tokenizer lacks {', '.join(missing)}, which a masked LM needs.",
                          title="Experiment unusable", hint=_BAD_DATA)
    return ids


def mask_tokens(ids: torch.Tensor, prob: float, specials: dict[str, int], vocab: int,
                generator: torch.Generator) -> MLMBatch:
    """BERT masking: of a ``prob`` share of the ordinary tokens (all but ``specials``' pad, cls and
    sep), 80 % ``[MASK]``, 10 % a random token below ``vocab``, 10 % kept; every row gets at least one."""
    ordinary = (ids != specials["pad"]) & (ids != specials["cls"]) & (ids != specials["sep"])
    chosen = (torch.rand(ids.shape, generator=generator) < prob) & ordinary
    empty = ~chosen.any(dim=1)
    chosen[empty] = ordinary[empty] & (ordinary[empty].cumsum(dim=1) == 1)
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    roll = torch.rand(ids.shape, generator=generator)
    randoms = torch.randint(0, vocab, ids.shape, generator=generator)
    inputs = torch.where(chosen & (roll < 0.8), torch.full_like(ids, specials["mask"]), ids)
    inputs = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), randoms, inputs)
    return MLMBatch(inputs, labels)


class TokenRows:
    """The rows of token shards (memory-mapped), checked against the model: 2-D, ``seq_len`` wide,
    ids below ``vocab``."""

    def __init__(self, paths: Sequence[Path], seq_len: int, vocab: int):
        if not paths:
            raise ShardError("This experiment lists no token shards to train on.", code="bad_shard", hint=_BAD_DATA)
        self.arrays = [self._load(Path(p), seq_len, vocab) for p in paths]
        self.ends = np.cumsum([len(a) for a in self.arrays])

    @staticmethod
    def _load(path: Path, seq_len: int, vocab: int) -> np.ndarray:
        try:
            rows = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise ShardError(f"The data shard {path.name} is not a token array (.npy): {exc}", code="bad_shard",
                             hint=_BAD_DATA) from exc
        if rows.ndim != 2 or rows.shape[1] != seq_len or not np.issubdtype(rows.dtype, np.integer):
            raise ShardError(f"The data shard {path.name} holds {rows.dtype} rows of shape {rows.shape[1:]}; the "
                             f"model takes integer rows of {seq_len} tokens.", code="bad_shard", hint=_BAD_DATA)
        if len(rows) == 0:
            raise ShardError(f"The data shard {path.name} is empty.", code="bad_shard", hint=_BAD_DATA)
        top, low = int(rows.max()), int(rows.min())
        if top >= vocab or low < 0:
            raise ShardError(f"The data shard {path.name} holds token id {top if top >= vocab else low}, outside "
                             f"the model's vocabulary of {vocab}.", code="bad_shard", hint=_BAD_DATA)
        return rows

    def take(self, index: np.ndarray) -> torch.Tensor:
        """Rows at global ``index`` as a LongTensor."""
        which = np.searchsorted(self.ends, index, side="right")
        starts = np.concatenate([[0], self.ends[:-1]])
        out = [self.arrays[w][i - starts[w]] for w, i in zip(which, index, strict=True)]
        return torch.from_numpy(np.stack(out).astype(np.int64))

    def __len__(self) -> int:
        return int(self.ends[-1])


class DeclaredRecipe:
    """A ``causal-lm`` or ``masked-lm`` recipe (see ``dedloc_core.engine.recipes.base.Recipe``)."""

    def __init__(self, name: str, params: declared.DeclaredParams, tokenizer: Path | None = None):
        self.name, self.params, self.family = name, params, type(params).__struct_config__.tag
        self.masked = name == "masked-lm"
        self.vocab = params.config.vocab_size
        tok = self._tokenizer(tokenizer) if tokenizer is not None else None
        self.specials = special_ids(tok) if self.masked else {}

    def _tokenizer(self, path: Path):
        """The experiment's tokenizer, checked against the model's vocabulary."""
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises its own Exception for a bad file
            raise RecipeError(f"The experiment's tokenizer cannot be read: {exc}", title="Experiment unusable",
                              hint=_BAD_DATA) from exc
        size = tok.get_vocab_size(with_added_tokens=True)
        if size > self.vocab:
            raise RecipeError(f"The experiment's tokenizer has {size} tokens, more than the model's vocabulary of "
                              f"{self.vocab}.", title="Experiment unusable", hint=_BAD_DATA)
        return tok

    def config(self) -> Any:
        import transformers

        values = {f: getattr(self.params.config, f) for f in self.params.config.__struct_fields__}
        if self.family == "gpt2":
            values.update(bos_token_id=None, eos_token_id=None)  # GPT-2's defaults (50256): outside most vocabularies
        if self.masked:
            values.setdefault("pad_token_id", self.specials["pad"])
        return getattr(transformers, _CLASSES[self.family][0])(**values)

    def build_model(self, seed: int = 0) -> nn.Module:
        import transformers

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return getattr(transformers, _CLASSES[self.family][1])(self.config())

    def build_optimizer(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        o = self.params.optimizer
        cls = Lamb if o.name == "lamb" else ClippedAdamW
        return cls(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                   max_grad_norm=o.max_grad_norm)

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        o = self.params.optimizer
        return torch.optim.lr_scheduler.LambdaLR(optimizer, Schedule(o.warmup_steps, o.decay, o.total_steps,
                                                                     o.min_lr_ratio))

    def batches(self, shard_paths: Sequence[Path], batch_size: int, seed: int) -> Iterator[Any]:
        """Endless random rows of the shards, reproducible per seed (masked: masked anew each time)."""
        rows = TokenRows(shard_paths, self.params.seq_len, self.vocab)
        rng, generator = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
        while True:
            batch = rows.take(rng.integers(0, len(rows), size=batch_size))
            yield self._masked(batch, generator) if self.masked else batch

    def _masked(self, batch: torch.Tensor, generator: torch.Generator) -> MLMBatch:
        return mask_tokens(batch, self.params.mask_prob, self.specials, self.vocab, generator)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        device = model_device(model)
        if self.masked:
            return self._masked_loss(model, batch.input_ids.to(device), batch.labels.to(device))
        batch = batch.to(device)
        return model(input_ids=batch, labels=batch).loss

    def _masked_loss(self, model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """transformers' masked-LM loss, with the vocabulary head applied to the masked positions only:
        the head over every position (a 32,000-word vocabulary at 512 positions) took half of a small
        model's time, and 85 % of its rows go into no loss."""
        encoder, head = _MLM_PARTS[self.family]
        hidden = getattr(model, encoder)(input_ids=input_ids).last_hidden_state
        where = labels != -100
        logits = getattr(model, head)(hidden[where])
        return nn.functional.cross_entropy(logits.float(), labels[where])

    def evaluate(self, model: nn.Module, shard_paths: Sequence[Path], max_batches: int = 8) -> float:
        """Mean loss over the first rows of the held-out shard(s) (masked: a fixed masking)."""
        rows = TokenRows(shard_paths, self.params.seq_len, self.vocab)
        batch = rows.take(np.arange(min(len(rows), max_batches * EVAL_BATCH)))
        generator = torch.Generator().manual_seed(EVAL_MASK_SEED)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                chunks = batch.split(EVAL_BATCH)
                losses = [self.loss(model, self._masked(c, generator) if self.masked else c).item() for c in chunks]
        finally:
            model.train(was_training)
        return sum(losses) / len(losses)


def build(name: str, params: declared.DeclaredParams, tokenizer: Path | None = None) -> DeclaredRecipe:
    return DeclaredRecipe(name, params, tokenizer)
