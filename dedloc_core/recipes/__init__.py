"""Built-in recipes: a model, its data pipeline, loss and evaluation, chosen by name.

The code is organized as follows:

- ``params``: torch-free parameter schemas (the catalog validates against them).
- ``base``: the ``Recipe`` interface shared by all recipes.
- ``text``: the byte-level tokenizer and text-shard datasets.
- ``tiny_lm``: a small causal transformer language model (the demo's and the tests' default).
- ``albert_mlm``: the paper's ALBERT masked-language-model pretraining.

Importing this package does not import torch; ``load_recipe`` does.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..errors import RecipeError
from .params import PARAMS_BY_RECIPE

if TYPE_CHECKING:
    from .base import Recipe

_MODULES = {"tiny-lm": "tiny_lm", "albert-mlm": "albert_mlm"}
RECIPE_NAMES: frozenset[str] = frozenset(PARAMS_BY_RECIPE)


def validate_params(name: str, params: dict[str, Any]):
    """Return the typed parameters of recipe ``name``; raise RecipeError if unknown or invalid."""
    if name not in PARAMS_BY_RECIPE:
        raise RecipeError(f"Unknown recipe {name!r}; this app knows {sorted(RECIPE_NAMES)}.")
    try:
        return PARAMS_BY_RECIPE[name].model_validate(params)
    except ValueError as exc:
        raise RecipeError(f"Invalid parameters for recipe {name!r}: {exc}") from exc


def load_recipe(name: str, params: dict[str, Any] | None = None) -> Recipe:
    """Build recipe ``name`` with ``params`` (imports torch)."""
    typed = validate_params(name, params or {})
    module = importlib.import_module(f"{__name__}.{_MODULES[name]}")
    return module.build(typed)
