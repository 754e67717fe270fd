"""In-process DiLoCo vs sync simulation (no network, no hivemind swarm), to choose what to run in
bench/diloco_vs_sync.py: the same tiny-lm model, data streams (one per peer, seeds 1..2) and update
rules, in one process, one thread.

    .venv/bin/python bench/diloco_sim.py --mode sync --rounds 3          # ideal large-batch training
    .venv/bin/python bench/diloco_sim.py --rounds 10 --olr 1.0 --omom 0 --q8 1 --stale 20
    .venv/bin/python bench/diloco_sim.py --rounds 3 --H 200 --olr 1.0 --omom 0 --q4 1 --ef 1

``--stale N``: N inner steps of every round but the first are made while the sync "runs" and are
carried onto the new outer model (diloco.py's one-step-stale update). ``--q8 1`` / ``--q4 1``: each
peer's delta goes through hivemind's 8-bit codec / our 4-bit one (engine/quant4.py) before averaging,
as in hivemind's all-reduce: each tensor is reduced by one peer (split by size, as hivemind's
partition does), which keeps its own part exact and gets the others' through the codec; the outer
model is peer 0's view (the others' would be about the same; the leader's is copied at resyncs):
the reducer's average on its own tensors, on the others' its decoded part plus the reducer's reply
through the codec (``--reply 0``: the reducer's average everywhere; ``--exact-own 0``: every part
through the codec, no reply: the sim's model before the 4-bit codec). ``--ef 1``: error feedback: what the
codec dropped from a peer's delta is added to its next delta (delta_averaging.ErrorFeedback).

Prints one JSON line with the eval loss of the outer model (``eval``) and bytes per sample
estimated as bench/diloco_vs_sync.py counts them (each peer sends (P-1)/P of the vector and replies
for its own part: 2 (P-1)/P of the vector's wire size a round, over the samples it trained): sync
(fp16 gradients every global step: ``sync_bps``), DiLoCo (``diloco_bps``, the codec's real wire
size for every parameter tensor) and their ratio (``ratio`` = 2 H n / wire bytes; the network's
DHT and matchmaking traffic left out). Figures: bench/README.md.
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
    from hivemind.compression import deserialize_torch_tensor
    from hivemind.compression.base import CompressionInfo

    from dedloc_core.engine import hivemind_ext
    from dedloc_core.engine.delta_averaging import CODECS
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
    ap.add_argument("--q4", type=int, default=0, help="1: deltas through the 4-bit codec")
    ap.add_argument("--ef", type=int, default=0, help="1: error feedback (the codec's loss goes into the next delta)")
    ap.add_argument("--exact-own", type=int, default=1, help="0: a reducer's own part goes through the codec too")
    ap.add_argument("--reply", type=int, default=1, help="0: leave out the codec's error on the reducer's reply")
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

    name = "4bit" if a.q4 else "8bit" if a.q8 else "none"
    codec = CODECS[name]()

    def wire(t):
        return t if name == "none" else deserialize_torch_tensor(codec.compress(t, CompressionInfo.from_tensor(t)))

    outer = recipe.build_model(seed=0)
    oparams = list(outer.parameters())
    n = sum(p.numel() for p in oparams)
    wire_bytes = sum(len(codec.compress(p.detach(), CompressionInfo.from_tensor(p)).buffer) for p in oparams)
    sync_bps = 2 * (PEERS - 1) / PEERS * 2 * n / (a.gb / PEERS)  # fp16 each global step of gb samples
    diloco_bps = 2 * (PEERS - 1) / PEERS * wire_bytes / (a.H * a.gb / PEERS)
    owner, seen = [], 0  # which peer reduces each tensor (hivemind's partition: by cumulative size)
    for p in oparams:
        owner.append(min(PEERS - 1, int(PEERS * (seen + p.numel() / 2) / n)) if a.exact_own else -1)
        seen += p.numel()
    residual = [[torch.zeros_like(p) for p in oparams] for _ in range(PEERS)]
    oopt = torch.optim.SGD(oparams, lr=a.olr, momentum=a.omom, nesterov=a.omom > 0)
    models = [copy.deepcopy(outer) for _ in range(PEERS)]
    opts = [recipe.build_optimizer(mm.parameters()) for mm in models]
    scheds = [schedule(o) for o in opts]

    def inner(i: int, count: int) -> None:
        for _ in range(count):
            opts[i].zero_grad()
            recipe.loss(models[i], next(streams[i])).backward()
            opts[i].step()
            if scheds[i]:
                scheds[i].step()

    for r in range(a.rounds):
        for i in range(PEERS):  # inner steps since the last launch (H, less those made during the last sync)
            inner(i, a.H - (a.stale if r else 0))
        launch = [[p.detach().clone() for p in mm.parameters()] for mm in models]
        deltas = [[o.detach() - x + e for o, x, e in zip(oparams, loc, res, strict=True)]
                  for loc, res in zip(launch, residual, strict=True)]
        sent = [[d[k] if owner[k] == i else wire(d[k]) for k in range(len(oparams))] for i, d in enumerate(deltas)]
        avg = [sum(s[k] for s in sent) / PEERS for k in range(len(oparams))]  # each tensor's reducer's view
        if a.reply and a.exact_own:  # peer 0's view: its decoded part plus the reducer's reply through the codec
            avg = [g if owner[k] == 0 else sent[0][k] + wire(g - sent[0][k]) for k, g in enumerate(avg)]
        if a.ef:
            residual = [[x - y for x, y in zip(d, s, strict=True)] for d, s in zip(deltas, sent, strict=True)]
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
                          params=n, wire_bytes=wire_bytes, sync_bps=round(sync_bps, 2),
                          diloco_bps=round(diloco_bps, 3), ratio=round(sync_bps / diloco_bps, 1),
                          secs=time.time() - began)))


if __name__ == "__main__":
    main()
