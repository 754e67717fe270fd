"""Byte-level tokenizer and text-shard datasets shared by the text recipes.

Tokens are the bytes 0..255 of the UTF-8 text; the masked-LM recipe adds four special ids above
them (``PAD``, ``MASK``, ``CLS``, ``SEP``). Shards are small text files read whole into memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from importlib.resources.abc import Traversable
from pathlib import Path

import numpy as np
import torch

from dedloc_core.paths import resource

BYTE_VOCAB = 256
PAD, MASK, CLS, SEP = 256, 257, 258, 259
VOCAB_WITH_SPECIALS = 260

TextSource = Path | Traversable


def encode(text: str) -> list[int]:
    """Token ids of ``text`` (its UTF-8 bytes)."""
    return list(text.encode("utf-8"))


def decode(ids: Sequence[int]) -> str:
    """Text of ``ids``; special ids are dropped and invalid UTF-8 is replaced."""
    return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")


def _manifest() -> dict:
    return json.loads(resource("corpus", "manifest.json").read_text(encoding="utf-8"))


def corpus_shards() -> list[Traversable]:
    """The training shards of the corpus shipped in ``resources/corpus``."""
    return [resource("corpus", entry["name"]) for entry in _manifest()["shards"]]


def corpus_eval() -> list[Traversable]:
    """The held-out evaluation text of the shipped corpus."""
    return [resource("corpus", _manifest()["eval"]["name"])]


def load_tokens(paths: Sequence[TextSource]) -> np.ndarray:
    """All bytes of ``paths`` as one uint8 array (files joined by a newline)."""
    if not paths:
        raise ValueError("no text shards given")
    parts = [np.frombuffer(path.read_bytes(), dtype=np.uint8) for path in paths]
    newline = np.array([ord("\n")], dtype=np.uint8)
    joined = [part for p in parts for part in (p, newline)][:-1]
    return np.concatenate(joined)


def _gather(tokens: np.ndarray, starts: np.ndarray, width: int) -> torch.Tensor:
    index = starts[:, None] + np.arange(width)[None, :]
    return torch.from_numpy(tokens[index].astype(np.int64))


class TextWindows:
    """Endless random windows of ``seq_len + 1`` tokens from text shards, reproducible per seed.

    Different seeds give independent streams, so peers of a swarm each see different windows.
    """

    def __init__(self, paths: Sequence[TextSource], seq_len: int, seed: int):
        self.tokens = load_tokens(paths)
        self.width = seq_len + 1
        if len(self.tokens) < self.width:
            raise ValueError(f"text has {len(self.tokens)} bytes, fewer than a window of {self.width}")
        self.rng = np.random.default_rng(seed)

    def batch(self, batch_size: int) -> torch.Tensor:
        """The next ``[batch_size, seq_len + 1]`` LongTensor."""
        starts = self.rng.integers(0, len(self.tokens) - self.width + 1, size=batch_size)
        return _gather(self.tokens, starts, self.width)

    def batches(self, batch_size: int) -> Iterator[torch.Tensor]:
        """An endless stream of batches."""
        while True:
            yield self.batch(batch_size)


def eval_windows(paths: Sequence[TextSource], seq_len: int, n: int) -> torch.Tensor:
    """A fixed ``[n, seq_len + 1]`` LongTensor of windows evenly spaced over ``paths``."""
    tokens = load_tokens(paths)
    width = seq_len + 1
    if len(tokens) < width:
        raise ValueError(f"text has {len(tokens)} bytes, fewer than a window of {width}")
    starts = np.linspace(0, len(tokens) - width, num=n).astype(np.int64)
    return _gather(tokens, starts, width)
