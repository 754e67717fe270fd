"""A lab node's solo rate: the bare training loop of a recipe (forward, backward, no swarm, one
torch thread like a lab worker), run inside the node's namespace and CPU group.

    python solo.py RECIPE PARAMS_JSON BATCH SECONDS   ->  prints "samples/s" as one number
    python solo.py RECIPE PARAMS_JSON BATCH SECONDS stream  ->  a line "MONOTONIC SAMPLES" after
                                                                every micro-batch, for SECONDS

Run by ``netlab.solo_rates`` (and ``netlab.peers.Reference``, the stream beside a swarm); the
worker's extra work (accumulating gradients, the DHT, averaging) is what the swarm's utilization
measures against this rate.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    recipe_name, params = sys.argv[1], json.loads(sys.argv[2])
    batch_size, seconds = int(sys.argv[3]), float(sys.argv[4])
    stream = sys.argv[5:6] == ["stream"]
    import torch

    from dedloc_core.engine.recipes import load_recipe

    torch.set_num_threads(1)
    recipe = load_recipe(recipe_name, params)
    model = recipe.build_model(seed=0)
    batches = recipe.batches([], batch_size, seed=0)
    for _ in range(3):  # warm-up
        recipe.loss(model, next(batches)).backward()
    samples, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        model.zero_grad(set_to_none=True)
        recipe.loss(model, next(batches)).backward()
        samples += batch_size
        if stream:
            print(f"{time.monotonic():.4f} {samples}", flush=True)
    print(f"{samples / (time.perf_counter() - began):.3f}", flush=True)


if __name__ == "__main__":
    main()
