"""The built-in recipes as the catalog sees them: their names and parameter schemas (no torch).

The recipes themselves (model, data, loss) are in ``dedloc_core.engine.recipes``, which reads its
parameters from here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dedloc_core.errors import RecipeError


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
RECIPE_NAMES: frozenset[str] = frozenset(PARAMS_BY_RECIPE)


def validate_params(name: str, params: dict[str, Any]):
    """Return the typed parameters of recipe ``name``; raise RecipeError if unknown or invalid."""
    if name not in PARAMS_BY_RECIPE:
        raise RecipeError(f"Unknown recipe {name!r}; this app knows {sorted(RECIPE_NAMES)}.")
    try:
        return PARAMS_BY_RECIPE[name].model_validate(params)
    except ValueError as exc:
        raise RecipeError(f"Invalid parameters for recipe {name!r}: {exc}") from exc
