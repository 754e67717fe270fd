"""The training loop's CPU per micro-batch: the bare loop, the worker's optimizer copying each
micro-batch's gradients to hivemind's accumulators ("copy", hivemind's way, and how sync mode ran
before), and accumulating in ``.grad`` ("in .grad", ``StatelessGradientAverager.accumulate_in_grads``,
sync mode with overlap now). Blocks of each, interleaved, in one process; the loop's thread CPU time.

    .venv/bin/python bench/accumulate.py [--blocks 4] [--micro-batches 300] [--batch 8]

A lone optimizer as the worker builds it (``swarm.build_optimizer``, overlap on, a target batch it
never reaches) on the netlab's ``tiny-lm`` (bench/swarm_netlab.py's RECIPE), one torch thread. Pin it
to one CPU (``taskset -c 1``) on a busy machine. Last line: ``in .grad / copy: X``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

RECIPE = {"d_model": 128, "n_layers": 2, "n_heads": 2, "seq_len": 32, "lr": 0.003, "warmup_steps": 0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=300, help="per block")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)

    import torch

    from dedloc_core.engine import swarm
    from dedloc_core.engine.recipes import load_recipe

    swarm.prepare_process()
    torch.set_num_threads(1)
    recipe = load_recipe("tiny-lm", RECIPE)
    model = recipe.build_model(seed=0)
    batches = recipe.batches([], args.batch, seed=0)
    cfg = swarm.SwarmConfig(run_id="accumulate_bench", target_batch_size=10**12, batch_size_per_step=args.batch,
                            overlap=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dht = swarm.start_dht(cfg)
    opt = swarm.build_optimizer(dht, cfg, model, recipe)
    averager, grads = opt.grad_averager, [p.grad for p in model.parameters()]

    def block(mode: str) -> float:
        if mode == "bare":
            began = time.thread_time()
            for _ in range(args.micro_batches):
                model.zero_grad(set_to_none=True)
                recipe.loss(model, next(batches)).backward()
            return (time.thread_time() - began) / args.micro_batches
        for param, grad in zip(model.parameters(), grads, strict=True):
            param.grad = grad  # the worker's shared .grad buffers
        averager.flush_grads_()
        averager.accumulate_in_grads = mode == "in .grad"
        began = time.thread_time()
        for _ in range(args.micro_batches):
            recipe.loss(model, next(batches)).backward()
            opt.step()
            opt.zero_grad()
        return (time.thread_time() - began) / args.micro_batches

    modes = ("bare", "copy", "in .grad")
    ms: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for _ in range(args.blocks):
            for mode in modes:
                ms[mode].append(1000 * block(mode))
    finally:
        opt.shutdown()
        dht.shutdown()
    mean = {m: sum(v) / len(v) for m, v in ms.items()}
    print(f"micro-batch {args.batch}, {args.blocks} blocks of {args.micro_batches}: loop CPU ms per micro-batch")
    for mode in modes:
        blocks = " ".join(f"{x:.2f}" for x in ms[mode])
        print(f"{mode:10} {mean[mode]:6.2f}   ({blocks}), / bare {mean[mode] / mean['bare']:.3f}")
    print(f"in .grad / copy: {mean['in .grad'] / mean['copy']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
