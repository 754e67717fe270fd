"""``albert-mlm``: the DeDLOC paper's ALBERT masked-language-model pretraining, on bytes.

ALBERT (``transformers.AlbertForMaskedLM``, randomly initialized, never downloaded) factorizes the
embeddings (``embedding_size`` < ``hidden_size``) and shares one layer's weights across all layers.
Tokens are bytes plus ``PAD``/``MASK``/``CLS``/``SEP`` (vocabulary 260); each sample is
``[CLS] bytes... [SEP]`` of ``seq_len`` tokens. ``transformers`` is imported only here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from dedloc_core.catalog.recipes import AlbertMLMParams

from . import declared, text
from .text import BYTE_VOCAB, CLS, MASK, PAD, SEP, VOCAB_WITH_SPECIALS, TextSource
from .tiny_lm import WarmupConstant, model_device

EVAL_BATCH = 16
EVAL_MASK_SEED = 0
SPECIALS = {"pad": PAD, "cls": CLS, "sep": SEP, "mask": MASK}  # every other id is a byte
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(embedding_size=64, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=256),
    "base": dict(embedding_size=128, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072),  # albert-base-v2
    "large": dict(embedding_size=128, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                  intermediate_size=4096),  # albert-large-v2
}  # fmt: skip


class MLMBatch(NamedTuple):
    """Masked inputs and labels (``-100`` except at masked positions), both ``[B, seq_len]``."""

    input_ids: torch.Tensor
    labels: torch.Tensor


def frame(windows: torch.Tensor) -> torch.Tensor:
    """Wrap byte windows ``[B, n]`` as ``[CLS] bytes [SEP]`` (``[B, n + 2]``)."""
    b = windows.shape[0]
    cls, sep = torch.full((b, 1), CLS, dtype=torch.long), torch.full((b, 1), SEP, dtype=torch.long)
    return torch.cat([cls, windows, sep], dim=1)


def mask_tokens(ids: torch.Tensor, mask_prob: float, generator: torch.Generator) -> MLMBatch:
    """BERT masking of byte positions: of a ``mask_prob`` share, 80% ``MASK``, 10% a random byte,
    10% kept; every row gets at least one masked byte (a row with none would make the loss NaN)."""
    inputs, labels = declared.mask_tokens(ids, mask_prob, SPECIALS, BYTE_VOCAB, generator)
    return MLMBatch(inputs, labels)


class AlbertMLMRecipe:
    """The ``albert-mlm`` recipe (see ``dedloc_core.engine.recipes.base.Recipe``)."""

    name = "albert-mlm"

    def __init__(self, params: AlbertMLMParams):
        self.params = params

    def config(self) -> Any:
        """The ``transformers.AlbertConfig`` of this size."""
        from transformers import AlbertConfig

        return AlbertConfig(
            vocab_size=VOCAB_WITH_SPECIALS, max_position_embeddings=self.params.seq_len,
            pad_token_id=PAD, bos_token_id=CLS, eos_token_id=SEP, type_vocab_size=1,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **SIZES[self.params.size],
        )  # fmt: skip

    def build_model(self, seed: int = 0) -> nn.Module:
        from transformers import AlbertForMaskedLM

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return AlbertForMaskedLM(self.config())

    def build_optimizer(self, params: Iterable[Any]) -> torch.optim.Optimizer:
        # The paper trained ALBERT with LAMB; torch ships no LAMB, so we use AdamW.
        p = self.params
        return torch.optim.AdamW(params, lr=p.lr, weight_decay=p.weight_decay, betas=(0.9, 0.999), eps=1e-6)

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupConstant(self.params.warmup_steps))

    def batches(self, shard_paths: Sequence[TextSource], batch_size: int, seed: int) -> Iterator[MLMBatch]:
        """Endless masked batches (the shipped corpus if no paths), reproducible per seed."""
        # Windows of seq_len - 2 bytes, framed as [CLS] ... [SEP].
        windows = text.TextWindows(shard_paths or text.corpus_shards(), self.params.seq_len - 3, seed)
        generator = torch.Generator().manual_seed(seed)
        while True:
            yield mask_tokens(frame(windows.batch(batch_size)), self.params.mask_prob, generator)

    def loss(self, model: nn.Module, batch: MLMBatch) -> torch.Tensor:
        device = model_device(model)
        return model(input_ids=batch.input_ids.to(device), labels=batch.labels.to(device)).loss

    def evaluate(self, model: nn.Module, shard_paths: Sequence[TextSource], max_batches: int = 8) -> float:
        """Mean MLM loss over fixed windows and a fixed masking (the shipped ``eval.txt`` if no paths)."""
        n = max_batches * EVAL_BATCH
        windows = text.eval_windows(shard_paths or text.corpus_eval(), self.params.seq_len - 3, n)
        generator = torch.Generator().manual_seed(EVAL_MASK_SEED)
        batch = mask_tokens(frame(windows), self.params.mask_prob, generator)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                chunks = zip(batch.input_ids.split(EVAL_BATCH), batch.labels.split(EVAL_BATCH), strict=True)
                losses = [self.loss(model, MLMBatch(*chunk)).item() for chunk in chunks]
        finally:
            model.train(was_training)
        return sum(losses) / len(losses)


def build(params: AlbertMLMParams) -> AlbertMLMRecipe:
    """The ``albert-mlm`` recipe with ``params``."""
    return AlbertMLMRecipe(params)
