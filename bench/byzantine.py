"""Byzantine peers: what one attacker among four peers does to the eval loss, with `mean` and
`centered_clip` aggregation (engine/robust.py, hivemind_ext.robust_reduce).

    .venv/bin/python bench/byzantine.py [--steps 20] [--attacks nan,scale,flip,noise] [--quick]
        [--model d64x2s32] [--batch 8] [--radius 1.0] [--iterations 3] [--keep DIR]

Four real peers on loopback, each its own process (real hivemind, real p2pd), train tiny-lm on the
shipped corpus with hivemind.Optimizer as the worker builds it (``swarm.build_optimizer``, the
project's patches installed, ``robust.configure`` as the worker calls it from the catalog). Peer 3
is the attacker in every configuration but the honest one, where it is an honest peer.

The attacker is a bench-only piece (nothing in the product knows of it): right before each
gradient all-reduce, after hivemind loaded its accumulated gradients into the averager's tensors
(``GradientAverager.load_accumulators_into_averager_``), it corrupts those tensors, i.e. every part
it sends to every reducer:

- ``nan``: all NaN;
- ``scale``: its gradient x1000;
- ``flip``: its gradient x-10;
- ``noise``: Gaussian noise with the norm of its gradient (per tensor), in place of the gradient.

Its own reducer runs the product's code (it reduces its share of the parts honestly, as with any
peer running our client). A hostile reducer's NaN/inf averages fail the round (patch 7); its finite
garbage averages are not covered (see bench/README.md).

Lockstep, so that every configuration sees the same data and the same number of steps: the target
batch is one micro-batch (``--batch``) and the peers pass a barrier after each micro-batch's backward
pass, so all four call ``opt.step()`` together, every step is one all-reduce among the four (weights
equal) and one optimizer step. Peer i reads the corpus in the same order in every configuration
(seed 100 + i); the model starts from the same seed; the eval is the recipe's fixed held-out
windows of ``eval.txt``. Each honest peer evaluates its own model after ``--steps`` steps; a
configuration's figure is the mean over the three honest peers (0-2).

Configurations: ``honest`` (mean aggregation, no attacker), then for each attack ``mean`` and
``centered_clip``. The last line: ``byzantine: worst robust/honest X, worst mean/honest Y``
(the worst over the attacks of centered_clip's and mean's eval loss over the honest swarm's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ATTACKS = ("nan", "scale", "flip", "noise")
PEERS = 4
ATTACKER = PEERS - 1
DESCRIBE = {"nan": "all NaN", "scale": "gradient x1000", "flip": "gradient x-10",
            "noise": "Gaussian, gradient's norm"}


def parse_model(spec: str) -> dict:
    import re

    m = re.fullmatch(r"d(\d+)x(\d+)(?:s(\d+))?", spec)
    if not m:
        raise SystemExit(f"--model: expected e.g. d64x2s32, got {spec!r}")
    return {"d_model": int(m[1]), "n_layers": int(m[2]), "seq_len": int(m[3] or 32), "n_heads": 2,
            "lr": 0.01, "warmup_steps": 0, "dropout": 0.0}


# ---- the attacker (bench only) -------------------------------------------------------------------


def corrupt_before_averaging(opt, attack: str, seed: int) -> None:
    """Make ``opt`` (a hivemind.Optimizer) send corrupted gradients: its averager's tensors are
    overwritten right after hivemind loads the accumulated gradients into them."""
    import torch

    averager = opt.grad_averager
    load = averager.load_accumulators_into_averager_
    gen = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def load_corrupted() -> None:
        load()
        with averager.get_tensors() as tensors:
            for t in tensors:
                if attack == "nan":
                    t.fill_(float("nan"))
                elif attack == "scale":
                    t.mul_(1000.0)
                elif attack == "flip":
                    t.mul_(-10.0)
                elif attack == "noise":
                    noise = torch.randn(t.shape, generator=gen, dtype=t.dtype)
                    t.copy_(noise * (t.norm() / noise.norm().clamp_min(1e-12)))
                else:
                    raise ValueError(f"unknown attack {attack!r}")

    averager.load_accumulators_into_averager_ = load_corrupted


# ---- one peer (a child process) -------------------------------------------------------------------


class Barrier:
    """All ``PEERS`` peers of a configuration meet here (files in the work folder); a peer that fails
    writes ``abort``, and the others stop waiting. With ``grace``, the honest peers wait for the
    attacker at most that long once they are all there (then 2 s once it has missed a barrier): a
    banned attacker spends a whole matchmaking timeout per step, and the honest peers need not."""

    def __init__(self, work: Path, name: str, index: int, grace: float | None = None):
        self.work, self.name, self.index, self.count = work, name, index, 0
        self.grace, self.missed = grace, 0

    def wait(self, timeout: float) -> None:
        self.count += 1
        stem = f"{self.name}.b{self.count}"
        (self.work / f"{stem}.{self.index}").touch()
        deadline, honest_since = time.monotonic() + timeout, None
        while not all((self.work / f"{stem}.{i}").exists() for i in range(PEERS)):
            if (self.work / f"{self.name}.abort").exists():
                raise SystemExit("another peer failed")
            if time.monotonic() > deadline:
                raise TimeoutError(f"barrier {self.count}: the other peers did not come")
            if self.grace is not None and all((self.work / f"{stem}.{i}").exists() for i in range(ATTACKER)):
                honest_since = honest_since or time.monotonic()
                if time.monotonic() - honest_since > (2.0 if self.missed else self.grace):
                    self.missed += 1
                    return
            time.sleep(0.02)


def run_peer(args: argparse.Namespace) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s peer%(peer)s %(name)s %(levelname)s %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_Tag(args.index))
    logging.getLogger("dedloc_core").setLevel(logging.INFO)
    work, conf = Path(args.work), json.loads(args.conf)
    try:
        out = peer_main(args.index, conf, args, work)
    except BaseException as exc:
        (work / f"{conf['name']}.abort").touch()
        logging.getLogger("byzantine").exception("peer %d failed", args.index)
        out = {"error": repr(exc)[:300]}
    (work / f"{conf['name']}.{args.index}.json").write_text(json.dumps(out))


class _Tag:
    def __init__(self, index: int):
        self.index = index

    def filter(self, record) -> bool:
        record.peer = self.index
        return True


def peer_main(index: int, conf: dict, args: argparse.Namespace, work: Path) -> dict:
    import torch

    from dedloc_core.engine import robust, swarm
    from dedloc_core.engine.recipes import load_recipe

    swarm.prepare_process()
    robust.configure(conf["aggregation"], args.radius, args.iterations)  # as the worker does, before forks
    torch.set_num_threads(1)
    torch.manual_seed(1000 + index)
    recipe = load_recipe("tiny-lm", parse_model(args.model))
    model = recipe.build_model(seed=0)
    cfg = swarm.SwarmConfig(run_id=f"byz_{conf['name']}", target_batch_size=args.batch,
                            batch_size_per_step=args.batch, matchmaking_time=args.matchmaking_time,
                            averaging_timeout=30.0, min_refresh_period=0.5)
    maddrs = work / f"{conf['name']}.maddrs"
    if index:
        deadline = time.monotonic() + 120
        while not maddrs.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        cfg.initial_peers = json.loads(maddrs.read_text())
    dht = swarm.start_dht(cfg)
    if index == 0:
        (work / "maddrs.tmp").write_text(json.dumps([str(m) for m in dht.get_visible_maddrs()]))
        (work / "maddrs.tmp").rename(maddrs)
    opt = swarm.build_optimizer(dht, cfg, model, recipe)
    attacker = conf["attack"] is not None and index == ATTACKER
    if attacker:
        corrupt_before_averaging(opt, conf["attack"], seed=7)
    batches = recipe.batches([], args.batch, seed=100 + index)
    barrier = Barrier(work, conf["name"], index, grace=15.0 if conf["attack"] and not attacker else None)
    honest_done = work / f"{conf['name']}.honest_done"
    # hivemind averages only once its tracker has seen other peers, and its tracker publishes a
    # peer's record only once it has accumulated samples: report one (the first step's report
    # replaces it), so that the peers see each other before step 1
    opt.tracker.report_local_progress(opt.local_epoch, 1)
    deadline = time.monotonic() + 120
    while opt.tracker.global_progress.num_peers < PEERS and time.monotonic() < deadline:
        time.sleep(0.2)
    if opt.tracker.global_progress.num_peers < PEERS:
        raise TimeoutError(f"the tracker sees {opt.tracker.global_progress.num_peers} peers after 120 s")
    barrier.wait(timeout=180)  # everyone joined and sees the others
    groups, began = [], time.monotonic()
    for _ in range(args.steps):
        if attacker and honest_done.exists():
            break  # the honest peers went on without it (banned): nothing left to attack
        loss = recipe.loss(model, next(batches))
        loss.backward()
        barrier.wait(timeout=300)
        rounds = opt.rounds_joined
        opt.step()
        opt.zero_grad()
        groups.append(opt.last_group_size if opt.rounds_joined > rounds else 0)  # 0: the round failed
    wall = time.monotonic() - began
    if not attacker:
        honest_done.touch()
    late = len(groups) < args.steps  # an attacker the honest peers went on without leaves without meeting
    if not late:
        barrier.wait(timeout=300)  # nobody leaves while others still average
    eval_loss = float("nan") if attacker else recipe.evaluate(model, [], max_batches=args.eval_batches)
    out = dict(eval_loss=eval_loss, epoch=opt.local_epoch, groups=groups, wall=wall,
               digest=swarm.param_digest(model), missed=barrier.missed)
    if not late:
        barrier.wait(timeout=300)
    opt.shutdown()
    dht.shutdown()
    return out


# ---- the parent -----------------------------------------------------------------------------------


def run_config(conf: dict, args: argparse.Namespace, work: Path) -> dict:
    log_path = work / f"{conf['name']}.log"
    shared = work / conf["name"]  # barrier files, addresses, results: fresh for every run
    shutil.rmtree(shared, ignore_errors=True)
    shared.mkdir(parents=True)
    procs = []
    with open(log_path, "w") as log:
        for i in range(PEERS):
            argv = [sys.executable, __file__, "--peer", "--index", str(i), "--conf", json.dumps(conf),
                    "--work", str(shared), "--steps", str(args.steps), "--model", args.model,
                    "--batch", str(args.batch), "--radius", str(args.radius), "--iterations", str(args.iterations),
                    "--matchmaking-time", str(args.matchmaking_time), "--eval-batches", str(args.eval_batches)]
            procs.append(subprocess.Popen(argv, stdout=log, stderr=log, cwd=ROOT))
        deadline = time.monotonic() + args.timeout
        try:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.5)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
    got = {}
    for i in range(PEERS):
        path = shared / f"{conf['name']}.{i}.json"
        got[i] = json.loads(path.read_text()) if path.exists() else {"error": "no result (timed out?)"}
    errors = {i: o["error"] for i, o in got.items() if "error" in o}
    if errors:
        raise SystemExit(f"{conf['name']}: peers failed ({errors}); see {log_path}")
    honest = [got[i] for i in range(PEERS) if conf["attack"] is None or i != ATTACKER]
    losses = [o["eval_loss"] for o in honest[:ATTACKER]]
    return dict(name=conf["name"], eval_loss=sum(losses) / len(losses), spread=max(losses) - min(losses),
                full_rounds=sum(g == PEERS for g in honest[0]["groups"]),
                failed_rounds=[sum(g == 0 for g in o["groups"]) for o in honest],  # per honest peer
                without_attacker=honest[0].get("missed", 0),
                epochs=[o["epoch"] for o in got.values()], wall=max(o["wall"] for o in got.values()),
                groups=honest[0]["groups"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per configuration")
    ap.add_argument("--attacks", default=",".join(ATTACKS), help=f"comma-separated, from {','.join(ATTACKS)}")
    ap.add_argument("--quick", action="store_true", help="10 steps, attacks flip and nan (a smoke run)")
    ap.add_argument("--model", default="d64x2s32")
    ap.add_argument("--batch", type=int, default=8, help="micro-batch = target batch of one peer")
    ap.add_argument("--radius", type=float, default=None, help="clip radius (default: the catalog's)")
    ap.add_argument("--iterations", type=int, default=None, help="clip iterations (default: the catalog's)")
    ap.add_argument("--matchmaking-time", type=float, default=2.0)
    ap.add_argument("--eval-batches", type=int, default=8, help="eval windows / 16")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
    ap.add_argument("--keep", default=None, help="keep the peers' logs in this folder")
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--conf", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        run_peer(args)
        return
    if args.quick:
        args.steps, args.attacks = 10, "flip,nan"
    attacks = [a for a in args.attacks.split(",") if a]
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown or not attacks:
        raise SystemExit(f"--attacks: unknown {unknown or 'none given'}; known: {', '.join(ATTACKS)}")
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    from dedloc_core.catalog.model import Experiment
    from dedloc_core.schema import fields as model_fields

    fields = model_fields(Experiment)
    args.radius = fields["clip_radius"].default if args.radius is None else args.radius
    args.iterations = fields["clip_iterations"].default if args.iterations is None else args.iterations
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="byzantine-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DEDLOC_HOME", str(work / "home"))

    configs = [dict(name="honest", attack=None, aggregation="mean")]
    for attack in attacks:
        configs += [dict(name=f"{attack}-mean", attack=attack, aggregation="mean"),
                    dict(name=f"{attack}-clip", attack=attack, aggregation="centered_clip")]
    began, figures = time.monotonic(), {}
    for conf in configs:
        figures[conf["name"]] = run_config(conf, args, work)
        f = figures[conf["name"]]
        print(f"  {conf['name']}: eval loss {f['eval_loss']:.4f} (honest peers within {f['spread']:.4f}), "
              f"rounds of 4: {f['full_rounds']}/{args.steps}, failed per honest peer: {f['failed_rounds']}, "
              f"steps without the attacker: {f['without_attacker']}, {f['wall']:.0f} s", flush=True)
    (work / "figures.json").write_text(json.dumps(figures, indent=1))

    honest = figures["honest"]["eval_loss"]
    print(f"{PEERS} peers (peer {ATTACKER} the attacker), tiny-lm {args.model}, micro-batch = target batch "
          f"{args.batch} per peer, {args.steps} steps; centered_clip radius {args.radius}, "
          f"{args.iterations} iterations; {time.monotonic() - began:.0f} s")
    print(f"{'attack':7} {'sends':27} {'honest':>8} {'mean':>8} {'clip':>8} {'mean/hon':>9} {'clip/hon':>9}")
    worst_mean = worst_clip = 0.0
    for attack in attacks:
        m, c = figures[f"{attack}-mean"]["eval_loss"], figures[f"{attack}-clip"]["eval_loss"]
        worst_mean, worst_clip = max(worst_mean, m / honest), max(worst_clip, c / honest)
        print(f"{attack:7} {DESCRIBE[attack]:27} {honest:8.4f} {m:8.4f} {c:8.4f} {m / honest:9.3f} {c / honest:9.3f}")
    if "nan" in attacks:
        print("nan: NaN/inf parts are dropped with mean and centered_clip alike (the product's behaviour);"
              " the sender is banned after 3 drops")
    print(f"byzantine: worst robust/honest {worst_clip:.3f}, worst mean/honest {worst_mean:.3f}")


if __name__ == "__main__":
    main()
