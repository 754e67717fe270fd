"""Built-in recipes: a model, its data pipeline, loss and evaluation, chosen by name.

The code is organized as follows:

- ``base``: the ``Recipe`` interface shared by all recipes.
- ``text``: the byte-level tokenizer and text-shard datasets.
- ``tiny_lm``: a small causal transformer language model (the demo's and the tests' default).
- ``albert_mlm``: the paper's ALBERT masked-language-model pretraining.
- ``declared``: ``causal-lm`` and ``masked-lm``, a transformers model declared by the catalog.

The names and parameter schemas live on the light side, in ``dedloc_core.catalog.recipes`` (the
catalog validates against them). Importing this package does not import torch; ``load_recipe`` does.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dedloc_core.catalog.recipes import DECLARED, RECIPE_NAMES, validate_params

if TYPE_CHECKING:
    from .base import Recipe

__all__ = ["RECIPE_NAMES", "load_recipe", "validate_params"]

_MODULES = {"tiny-lm": "tiny_lm", "albert-mlm": "albert_mlm", "causal-lm": "declared", "masked-lm": "declared"}


def load_recipe(name: str, params: dict[str, Any] | None = None, tokenizer: Path | None = None) -> Recipe:
    """Build recipe ``name`` with ``params`` (imports torch); a declared model's with the experiment's
    ``tokenizer`` file, once fetched (its special tokens and size are checked against the model)."""
    typed = validate_params(name, params or {})
    module = importlib.import_module(f"{__name__}.{_MODULES[name]}")
    return module.build(name, typed, tokenizer) if name in DECLARED else module.build(typed)
