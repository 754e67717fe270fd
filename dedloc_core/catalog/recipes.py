"""The built-in recipes as the catalog sees them: their names and parameter schemas (no torch).

The recipes themselves (model, data, loss) are in ``dedloc_core.engine.recipes``, which reads its
parameters from here. ``causal-lm`` and ``masked-lm`` build a declared transformers model
(``declared``); ``tiny-lm`` and ``albert-mlm`` are our own, on bytes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from dedloc_core.errors import RecipeError
from dedloc_core.schema import describe

from .declared import FAMILIES, CausalLMParams, MaskedLMParams


class _Params(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    pass


class TinyLMParams(_Params):
    """A small causal transformer over bytes (vocabulary 256)."""

    d_model: Annotated[int, Meta(ge=16, le=4096)] = 256
    n_layers: Annotated[int, Meta(ge=1, le=48)] = 4
    n_heads: Annotated[int, Meta(ge=1, le=64)] = 4
    seq_len: Annotated[int, Meta(ge=8, le=4096)] = 128
    dropout: Annotated[float, Meta(ge=0.0, le=0.9)] = 0.0
    lr: Annotated[float, Meta(gt=0.0, le=1.0)] = 3e-3
    weight_decay: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.01
    warmup_steps: Annotated[int, Meta(ge=0, le=1_000_000)] = 10

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")


class AlbertMLMParams(_Params):
    """ALBERT masked-LM pretraining (factorized embeddings, cross-layer sharing)."""

    size: Literal["tiny", "base", "large"] = "tiny"
    seq_len: Annotated[int, Meta(ge=16, le=1024)] = 128
    mask_prob: Annotated[float, Meta(gt=0.0, lt=1.0)] = 0.15
    lr: Annotated[float, Meta(gt=0.0, le=1.0)] = 1e-3
    weight_decay: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.01
    warmup_steps: Annotated[int, Meta(ge=0, le=1_000_000)] = 10


PARAMS_BY_RECIPE: dict[str, Any] = {
    "tiny-lm": TinyLMParams,
    "albert-mlm": AlbertMLMParams,
    "causal-lm": CausalLMParams,
    "masked-lm": MaskedLMParams,
}
DECLARED = frozenset({"causal-lm", "masked-lm"})
RECIPE_NAMES: frozenset[str] = frozenset(PARAMS_BY_RECIPE)


def validate_params(name: str, params: dict[str, Any]):
    """Return the typed parameters of recipe ``name``; raise RecipeError if unknown or invalid (its
    ``__cause__`` is then the ``msgspec.ValidationError``). Numbers given as text are accepted."""
    if name not in PARAMS_BY_RECIPE:
        raise RecipeError(f"Unknown recipe {name!r}; this app knows {sorted(RECIPE_NAMES)}.")
    family = params.get("family") if isinstance(params, dict) else None
    if name in DECLARED and isinstance(family, str) and family not in FAMILIES[name]:
        raise RecipeError(f"Unknown model family {family[:40]!r} for recipe {name!r}; this app builds "
                          f"{', '.join(FAMILIES[name])} (a newer app may build more).")
    try:
        return msgspec.convert(params, PARAMS_BY_RECIPE[name], strict=False)
    except msgspec.ValidationError as exc:
        raise RecipeError(f"Invalid parameters for recipe {name!r}: {describe(exc)}") from exc
