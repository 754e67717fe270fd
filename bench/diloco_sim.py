"""In-process DiLoCo vs sync simulation (no network, no hivemind swarm), to choose what to run in
bench/diloco_vs_sync.py: the same tiny-lm model, data streams (one per peer, seeds 1..2) and update
rules, in one process, one thread.

    .venv/bin/python bench/diloco_sim.py --mode sync --rounds 3          # ideal large-batch training
    .venv/bin/python bench/diloco_sim.py --rounds 10 --olr 1.0 --omom 0 --q8 1 --stale 20

``--stale N``: N inner steps of every round but the first are made while the sync "runs" and are
carried onto the new outer model (diloco.py's one-step-stale update). ``--q8 1``: each peer's delta
goes through hivemind's 8-bit codec before averaging (an approximation of the all-reduce's error).
Prints one JSON line with the eval loss of the outer model (``eval``). Figures: bench/README.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PEERS = 2


def main() -> None:
    import torch
    from hivemind.compression import Uniform8BitQuantization, deserialize_torch_tensor
    from hivemind.compression.base import CompressionInfo

    from dedloc_core.engine import hivemind_ext
    from dedloc_core.engine.recipes import load_recipe

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="diloco", choices=["sync", "diloco"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--H", type=int, default=100, help="inner steps a round")
    ap.add_argument("--gb", type=int, default=256, help="global batch (sync); each peer's inner batch is gb/2")
    ap.add_argument("--lr", type=float, default=0.01, help="AdamW lr (both modes)")
    ap.add_argument("--olr", type=float, default=0.7, help="outer lr")
    ap.add_argument("--omom", type=float, default=0.9, help="outer Nesterov momentum (0: none)")
    ap.add_argument("--stale", type=int, default=0, help="inner steps overlapped with each sync")
    ap.add_argument("--q8", type=int, default=0, help="1: deltas through the 8-bit codec")
    ap.add_argument("--model", default="d64x2s32")
    ap.add_argument("--cosine", type=int, default=0, help="1: cosine inner lr decay to 0.1x (both modes)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    hivemind_ext.install()
    m = re.fullmatch(r"d(\d+)x(\d+)(?:s(\d+))?", a.model)
    recipe = load_recipe("tiny-lm", {"d_model": int(m[1]), "n_layers": int(m[2]), "seq_len": int(m[3] or 32),
                                     "n_heads": 2, "lr": a.lr, "warmup_steps": 0})
    steps, began = a.rounds * a.H, time.time()

    def schedule(opt):
        if not a.cosine:
            return None
        return torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: 0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / steps)))

    streams = [recipe.batches([], a.gb // PEERS, seed=i + 1) for i in range(PEERS)]
    if a.mode == "sync":
        model = recipe.build_model(seed=0)
        opt = recipe.build_optimizer(model.parameters())
        sched = schedule(opt)
        for _ in range(steps):
            opt.zero_grad()
            (sum(recipe.loss(model, next(st)) for st in streams) / PEERS).backward()
            opt.step()
            if sched:
                sched.step()
        print(json.dumps(dict(vars(a), eval=recipe.evaluate(model, []), secs=time.time() - began)))
        return

    codec = Uniform8BitQuantization()

    def wire(t):
        return deserialize_torch_tensor(codec.compress(t, CompressionInfo.from_tensor(t))) if a.q8 else t

    outer = recipe.build_model(seed=0)
    oparams = list(outer.parameters())
    oopt = torch.optim.SGD(oparams, lr=a.olr, momentum=a.omom, nesterov=a.omom > 0)
    models = [copy.deepcopy(outer) for _ in range(PEERS)]
    opts = [recipe.build_optimizer(mm.parameters()) for mm in models]
    scheds = [schedule(o) for o in opts]

    def inner(i: int, n: int) -> None:
        for _ in range(n):
            opts[i].zero_grad()
            recipe.loss(models[i], next(streams[i])).backward()
            opts[i].step()
            if scheds[i]:
                scheds[i].step()

    for r in range(a.rounds):
        for i in range(PEERS):  # inner steps since the last launch (H, less those made during the last sync)
            inner(i, a.H - (a.stale if r else 0))
        launch = [[p.detach().clone() for p in mm.parameters()] for mm in models]
        deltas = [[o.detach() - x for o, x in zip(oparams, loc, strict=True)] for loc in launch]
        avg = [sum(wire(d[k]) for d in deltas) / PEERS for k in range(len(oparams))]
        for i in range(PEERS):  # steps made while the sync runs (none after the last round)
            inner(i, 0 if r == a.rounds - 1 else a.stale)
        with torch.no_grad():
            for p, g in zip(oparams, avg, strict=True):
                p.grad = g.clone()
            oopt.step()
            oopt.zero_grad(set_to_none=True)
            for i, mm in enumerate(models):  # carry the inner progress onto the new outer model
                for p, o, b in zip(mm.parameters(), oparams, launch[i], strict=True):
                    p.copy_(o + (p - b))
    print(json.dumps(dict(vars(a), eval=recipe.evaluate(outer, []), local=recipe.evaluate(models[0], []),
                          secs=time.time() - began)))


if __name__ == "__main__":
    main()
