"""Parameter schemas of the built-in recipes. Torch-free, so the catalog can validate them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TinyLMParams(_Params):
    """A small causal transformer over bytes (vocabulary 256)."""

    d_model: int = Field(256, ge=16, le=4096)
    n_layers: int = Field(4, ge=1, le=48)
    n_heads: int = Field(4, ge=1, le=64)
    seq_len: int = Field(128, ge=8, le=4096)
    dropout: float = Field(0.0, ge=0.0, le=0.9)
    lr: float = Field(3e-3, gt=0.0, le=1.0)
    weight_decay: float = Field(0.01, ge=0.0, le=1.0)
    warmup_steps: int = Field(10, ge=0, le=1_000_000)

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyLMParams:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        return self


class AlbertMLMParams(_Params):
    """ALBERT masked-LM pretraining (factorized embeddings, cross-layer sharing)."""

    size: Literal["tiny", "base", "large"] = "tiny"
    seq_len: int = Field(128, ge=16, le=1024)
    mask_prob: float = Field(0.15, gt=0.0, lt=1.0)
    lr: float = Field(1e-3, gt=0.0, le=1.0)
    weight_decay: float = Field(0.01, ge=0.0, le=1.0)
    warmup_steps: int = Field(10, ge=0, le=1_000_000)


PARAMS_BY_RECIPE: dict[str, type[_Params]] = {
    "tiny-lm": TinyLMParams,
    "albert-mlm": AlbertMLMParams,
}
