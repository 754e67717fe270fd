"""The backbone's evaluation: every ``--eval-every`` global steps it measures the swarm's model (the
state it keeps) on held-out data, the learning curve's second line, which training losses cannot
show (they are each volunteer's, on its own batches, averaged as reported).

Held-out data: a declared model's ``data.eval`` token shard (``dedloc data prepare`` writes it),
read from the backbone's ``--data-dir`` when it is there with the catalog's hash, else fetched like
a volunteer's shards; the built-in recipes' own held-out text otherwise. A declared model without an
eval shard is not evaluated.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from dedloc_core.catalog.recipes import DECLARED
from dedloc_core.errors import DedlocError

from .shard_cache import ShardCache

logger = logging.getLogger(__name__)

EVAL_CACHE_BYTES = 2**30


class Evaluator:
    def __init__(self, exp, recipe, model, *, every: int, batches: int, data_dir: Path | None,
                 base_url: str | None, cache: Path):
        self.exp, self.recipe, self.model = exp, recipe, model
        self.every, self.batches = every, batches
        self.data_dir, self.base_url, self.cache = data_dir, base_url, cache
        self.last: int | None = None
        self.paths: list[Path] | None = None
        if every > 0 and exp.recipe in DECLARED and exp.data.eval is None:
            logger.info("No held-out shard in the catalog (data.eval): the backbone does not evaluate")
            self.every = 0

    def due(self, step: int) -> bool:
        """At the first look (step 0 included: the curve's starting point), then every ``every`` steps."""
        return self.every > 0 and (self.last is None or step >= self.last + self.every)

    def run(self, step: int) -> float | None:
        """The model's mean loss on the held-out data now; None (and no more tries) if that data fails."""
        self.last = step
        try:
            if self.paths is None:
                self.paths = self._held_out()
            loss = self.recipe.evaluate(self.model, self.paths, max_batches=self.batches)
        except (DedlocError, OSError, ValueError) as exc:
            logger.error("Evaluation stopped: %s", exc)
            self.every = 0
            return None
        logger.info("Evaluation at global step %d: loss %.4f", step, loss)
        return loss

    def _held_out(self) -> list[Path]:
        shard = self.exp.data.eval
        if shard is None:
            return []  # the built-in recipes' own held-out text
        if self.data_dir is not None and shard.url.startswith("data/"):  # what this backbone serves at /data/
            local = self.data_dir / shard.url.removeprefix("data/")
            if local.is_file() and hashlib.sha256(local.read_bytes()).hexdigest() == shard.sha256:
                return [local]
        cache = ShardCache(self.cache, max_bytes=EVAL_CACHE_BYTES)
        return [cache.fetch(shard, self.exp.data.base_url or self.base_url)]
