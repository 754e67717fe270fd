"""Declared architectures: a catalog entry names a model family of ``transformers`` and its config,
and the worker builds that model from the config alone (random weights; never a download, never
remote code). The catalog carries no code: a volunteer runs only what the installed client builds.

This side (no torch, no transformers: the tray app imports it) checks a declaration and sizes it:
parameters (exactly as transformers builds the model; ``tests/test_declared.py`` compares), training
memory, compute per sample, and the hardware that follows (``fit``). The families are a list here;
each config key the client accepts is a field with a range, so a typo or an absurd size is a clear
error in the catalog, not a crash in a worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec
from msgspec import Meta


class _Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True, omit_defaults=True):
    """A family's config: the keys transformers' config class takes, with its defaults."""

    vocab_size: Annotated[int, Meta(ge=8, le=1_000_000)]


Width = Annotated[int, Meta(ge=8, le=65_536)]
Layers = Annotated[int, Meta(ge=1, le=512)]
Heads = Annotated[int, Meta(ge=1, le=1024)]
Positions = Annotated[int, Meta(ge=8, le=1_048_576)]
Dropout = Annotated[float, Meta(ge=0.0, le=0.9)]
Eps = Annotated[float, Meta(gt=0.0, le=0.1)]
Init = Annotated[float, Meta(gt=0.0, le=1.0)]


def _divides(heads: int, width: int, what: str) -> None:
    if width % heads:
        raise ValueError(f"{what} ({width}) must be divisible by the number of attention heads ({heads})")


class LlamaConfig(_Config):
    hidden_size: Width
    intermediate_size: Annotated[int, Meta(ge=8, le=262_144)]
    num_hidden_layers: Layers
    num_attention_heads: Heads
    num_key_value_heads: Heads | None = None  # None: as many as the attention heads
    max_position_embeddings: Positions = 2048
    tie_word_embeddings: bool = False
    hidden_act: Literal["silu", "gelu", "relu"] = "silu"
    rms_norm_eps: Eps = 1e-6
    attention_dropout: Dropout = 0.0
    initializer_range: Init = 0.02

    def __post_init__(self) -> None:
        _divides(self.num_attention_heads, self.hidden_size, "hidden_size")
        kv = self.num_key_value_heads or self.num_attention_heads
        if self.num_attention_heads % kv:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({kv})")


class GPT2Config(_Config):
    n_embd: Width
    n_layer: Layers
    n_head: Heads
    n_positions: Positions = 1024
    n_inner: Annotated[int, Meta(ge=8, le=262_144)] | None = None  # None: 4 x n_embd
    activation_function: Literal["gelu_new", "gelu", "relu", "silu"] = "gelu_new"
    resid_pdrop: Dropout = 0.1
    embd_pdrop: Dropout = 0.1
    attn_pdrop: Dropout = 0.1
    layer_norm_epsilon: Eps = 1e-5
    tie_word_embeddings: bool = True
    initializer_range: Init = 0.02

    def __post_init__(self) -> None:
        _divides(self.n_head, self.n_embd, "n_embd")


class BertConfig(_Config):
    hidden_size: Width
    num_hidden_layers: Layers
    num_attention_heads: Heads
    intermediate_size: Annotated[int, Meta(ge=8, le=262_144)] = 3072
    hidden_act: Literal["gelu", "gelu_new", "relu", "silu"] = "gelu"
    hidden_dropout_prob: Dropout = 0.1
    attention_probs_dropout_prob: Dropout = 0.1
    max_position_embeddings: Positions = 512
    type_vocab_size: Annotated[int, Meta(ge=1, le=16)] = 2
    layer_norm_eps: Eps = 1e-12
    initializer_range: Init = 0.02

    def __post_init__(self) -> None:
        _divides(self.num_attention_heads, self.hidden_size, "hidden_size")


class RobertaConfig(BertConfig):
    # positions start after the pad id: max_position_embeddings must be seq_len + pad_token_id + 1
    pad_token_id: Annotated[int, Meta(ge=0)] = 1


class AlbertConfig(BertConfig):
    embedding_size: Width = 128  # factorized embeddings: vocabulary x 128, then a projection
    num_hidden_groups: Layers = 1  # layers share weights within a group: 1 is ALBERT's all-shared
    inner_group_num: Annotated[int, Meta(ge=1, le=16)] = 1
    intermediate_size: Annotated[int, Meta(ge=8, le=262_144)] = 16384
    hidden_act: Literal["gelu", "gelu_new", "relu", "silu"] = "gelu_new"
    hidden_dropout_prob: Dropout = 0.0
    attention_probs_dropout_prob: Dropout = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_hidden_layers % self.num_hidden_groups:
            raise ValueError(f"num_hidden_layers ({self.num_hidden_layers}) must be a multiple of "
                             f"num_hidden_groups ({self.num_hidden_groups})")


class Optimizer(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """The local optimizer and its schedule: AdamW or LAMB (DeDLOC's), linear warm-up over
    ``warmup_steps`` global steps, then constant, linear or cosine decay to ``min_lr_ratio`` x lr at
    ``total_steps``. Gradients are clipped to ``max_grad_norm`` (none if null) before each step."""

    name: Literal["adamw", "lamb"] = "adamw"
    lr: Annotated[float, Meta(gt=0.0, le=1.0)] = 1e-3
    betas: tuple[Annotated[float, Meta(ge=0.0, lt=1.0)], Annotated[float, Meta(ge=0.0, lt=1.0)]] = (0.9, 0.999)
    eps: Annotated[float, Meta(gt=0.0, le=1e-2)] = 1e-6
    weight_decay: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.01
    max_grad_norm: Annotated[float, Meta(gt=0.0, le=1e6)] | None = 1.0
    warmup_steps: Annotated[int, Meta(ge=0, le=10_000_000)] = 0
    decay: Literal["constant", "linear", "cosine"] = "constant"
    total_steps: Annotated[int, Meta(ge=1, le=100_000_000)] = 100_000
    min_lr_ratio: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0


class _Declared(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True, tag_field="family"):
    seq_len: Annotated[int, Meta(ge=8, le=32_768)]
    optimizer: Optimizer = Optimizer()

    def __post_init__(self) -> None:
        needed = self.seq_len + (self.config.pad_token_id + 1 if isinstance(self.config, RobertaConfig) else 0)
        if positions(self.config) < needed:
            raise ValueError(f"the config holds {positions(self.config)} positions, fewer than the "
                             f"{needed} that seq_len {self.seq_len} needs")


class LlamaLM(_Declared, tag="llama", kw_only=True):
    config: LlamaConfig


class GPT2LM(_Declared, tag="gpt2", kw_only=True):
    config: GPT2Config


class _Masked(_Declared, kw_only=True):
    mask_prob: Annotated[float, Meta(gt=0.0, lt=1.0)] = 0.15


class AlbertMLM(_Masked, tag="albert", kw_only=True):
    config: AlbertConfig


class BertMLM(_Masked, tag="bert", kw_only=True):
    config: BertConfig


class RobertaMLM(_Masked, tag="roberta", kw_only=True):
    config: RobertaConfig


CausalLMParams = LlamaLM | GPT2LM
MaskedLMParams = AlbertMLM | BertMLM | RobertaMLM
DeclaredParams = LlamaLM | GPT2LM | AlbertMLM | BertMLM | RobertaMLM
FAMILIES: dict[str, tuple[str, ...]] = {"causal-lm": ("llama", "gpt2"), "masked-lm": ("albert", "bert", "roberta")}


def positions(config: _Config) -> int:
    return config.n_positions if isinstance(config, GPT2Config) else config.max_position_embeddings


def parameters(params: DeclaredParams) -> int:
    """The model's parameter count, as transformers builds it (tied weights counted once)."""
    c = params.config
    if isinstance(c, LlamaConfig):
        d, kv = c.hidden_size, (c.num_key_value_heads or c.num_attention_heads)
        head = d // c.num_attention_heads
        layer = 2 * d * d + 2 * d * kv * head + 3 * d * c.intermediate_size + 2 * d
        return c.vocab_size * d * (1 if c.tie_word_embeddings else 2) + c.num_hidden_layers * layer + d
    if isinstance(c, GPT2Config):
        d, inner = c.n_embd, c.n_inner or 4 * c.n_embd
        layer = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * inner + inner) + (inner * d + d)
        embed = c.vocab_size * d * (1 if c.tie_word_embeddings else 2) + c.n_positions * d
        return embed + c.n_layer * layer + 2 * d
    d, i = c.hidden_size, c.intermediate_size
    block = 4 * (d * d + d) + 2 * d + (d * i + i) + (i * d + d) + 2 * d  # attention, its norm, FFN, norm
    if isinstance(c, AlbertConfig):
        e = c.embedding_size
        embed = (c.vocab_size + c.max_position_embeddings + c.type_vocab_size) * e + 2 * e
        shared = c.num_hidden_groups * c.inner_group_num * block + e * d + d  # shared groups, mapping in
        head = d * e + e + 2 * e + c.vocab_size  # dense, norm, decoder bias (decoder tied)
        return embed + shared + head
    embed = (c.vocab_size + c.max_position_embeddings + c.type_vocab_size) * d + 2 * d
    head = d * d + d + 2 * d + c.vocab_size  # transform, norm, decoder bias (decoder tied)
    return embed + c.num_hidden_layers * block + head


def _width(c: _Config) -> tuple[int, int, int]:
    """(hidden width, layers, attention heads)."""
    if isinstance(c, GPT2Config):
        return c.n_embd, c.n_layer, c.n_head
    return c.hidden_size, c.num_hidden_layers, c.num_attention_heads


# Bytes per parameter while training here: fp32 weights, gradients, Adam's two statistics, and what
# hivemind keeps beside them (the offloaded optimizer's copy, gradient accumulators, the averager's
# buffer): 7 x 4 bytes.
TRAIN_BYTES_PER_PARAMETER = 28
CPU_FLOPS = 2e10  # a desktop CPU's sustained fp32 rate in torch, roughly (several cores)
GPU_FLOPS = 2e13  # a consumer GPU's sustained rate, roughly
LARGEST_GPU_GB = 80.0  # a declaration needing more than this fits no volunteer
CPU_LIMIT_GB = 8.0  # above this, or a step too slow, a model is for GPUs only
CPU_LIMIT_SECONDS = 60.0  # a CPU's step of batch_size_per_step samples above this: GPUs only


@dataclass(frozen=True)
class Fit:
    """What a declared model needs: its size, the memory to train it with ``batch_size`` samples
    per micro-batch, the seconds such a micro-batch takes on a CPU and on a GPU, and whether it
    needs a GPU (and how much memory there)."""

    parameters: int
    memory_gb: float
    cpu_seconds: float
    gpu_seconds: float
    gpu_required: bool
    gpu_memory_gb: float | None

    def text(self) -> str:
        size = f"{self.parameters / 1e6:.1f} M parameters, {self.memory_gb:.1f} GB to train"
        if self.gpu_required:
            return f"{size}; needs a GPU with {self.gpu_memory_gb:g} GB"
        return f"{size}; about {self.cpu_seconds:.1f} s per micro-batch on a CPU"


def fit(params: DeclaredParams, batch_size: int) -> Fit:
    """Size the model: parameters, training memory (states plus activations, fp32), time per
    micro-batch of ``batch_size`` sequences (6 flops per parameter and token)."""
    n = parameters(params)
    d, layers, heads = _width(params.config)
    s = params.seq_len
    # activations kept for backward per layer (Korthikanti et al. 2022: 34 s b d + 5 a s^2 b in
    # 16-bit; twice that in fp32), plus the logits over the vocabulary
    activations = batch_size * layers * (34 * s * d + 5 * heads * s * s) * 2
    logits = 3 * batch_size * s * params.config.vocab_size * 4
    memory = (n * TRAIN_BYTES_PER_PARAMETER + activations + logits) / 2**30
    flops = 6 * n * batch_size * s
    cpu, gpu = flops / CPU_FLOPS, flops / GPU_FLOPS
    needs_gpu = memory > CPU_LIMIT_GB or cpu > CPU_LIMIT_SECONDS
    gpu_gb = float(math.ceil(memory * 1.2)) if needs_gpu else None  # 20 % for the CUDA context and allocator
    return Fit(n, memory, cpu, gpu, needs_gpu, gpu_gb)


def check_fits(params: DeclaredParams, batch_size: int) -> None:
    """Raise ValueError if no volunteer could train this model with ``batch_size`` per micro-batch."""
    f = fit(params, batch_size)
    if f.memory_gb * 1.2 > LARGEST_GPU_GB:
        raise ValueError(f"this model ({f.parameters / 1e9:.2f} B parameters, {f.memory_gb:.0f} GB to train "
                         f"with {batch_size} sequences per micro-batch) fits no volunteer's GPU "
                         f"({LARGEST_GPU_GB:g} GB at most)")
