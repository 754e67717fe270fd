"""Byzantine peers: what attackers among real peers do to the eval loss, with `mean` and
`centered_clip` aggregation (engine/robust.py, hivemind_ext.robust_reduce), and whether the honest
peers ban them.

    .venv/bin/python bench/byzantine.py [--steps 20] [--runs 2] [--attacks nan,...,alie,2of5] [--quick]
        [--peers 4] [--attackers 1] [--ipm-eps 0.5] [--alie-z 1.0]
        [--model d64x2s32] [--batch 8] [--radius 1.0] [--iterations 3] [--keep DIR]

``--peers`` real peers on loopback (default 4), each its own process (real hivemind, real p2pd),
train tiny-lm on the shipped corpus with hivemind.Optimizer as the worker builds it
(``swarm.build_optimizer``, the project's patches installed, ``robust.configure`` and
``bans.load`` as the worker calls them). The ``--attackers`` highest-indexed peers (default 1: peer
3) attack in every configuration but the honest one, where they are honest peers.

The attacker is a bench-only piece (nothing in the product knows of it). As a sender, right before
each gradient all-reduce, after hivemind loaded its accumulated gradients into the averager's
tensors (``GradientAverager.load_accumulators_into_averager_``), it replaces those tensors, i.e.
every part it sends to every reducer:

- ``nan``: all NaN;
- ``scale``: its gradient x1000;
- ``flip``: its gradient x-10;
- ``noise``: Gaussian noise with the norm of its gradient (per tensor), in place of the gradient;
- ``ipm`` (inner-product manipulation, Xie et al. 2020): -eps (``--ipm-eps``, 0.5) times its
  estimate of the honest mean, inside the clip radius. Its estimate is its own honest gradient:
  an omniscient attacker would use the other peers' gradients;
- ``alie`` (a little is enough, Baruch et al. 2019): mu - z sigma per coordinate (``--alie-z``,
  1.0), mu and sigma the mean and std of its gradients on ``ALIE_SAMPLES`` (4) micro-batches of its
  own each step: the one it trains on, from its usual data order, and 3 from a stream of its own.

As a reducer it runs the product's code, except in the ``reducer-*`` attacks: it sends honest
gradients, but ``robust.aggregate`` (what every reducer calls for the average of one part) is
wrapped in its process before hivemind forks its averagers, so the average it returns for its slice
is a finite lie, and its reducer's own records agree with it: ``reducer-flip`` -10 x the true
average, ``reducer-scale`` x100, ``reducer-shift`` the true average + 1.0.

Lockstep, so that every configuration sees the same data and the same number of steps: the target
batch is one micro-batch (``--batch``) and the peers pass a barrier after each micro-batch's backward
pass, so all call ``opt.step()`` together, every step is one all-reduce among them (weights equal)
and one optimizer step (a peer whose tracker had not yet read the others' progress finishes its step
once it has: ``finish_step``). Peer i reads the corpus in the same order in every configuration (seed
100 + i); the model starts from the same seed; the eval is the recipe's fixed held-out windows of
``eval.txt``. Each honest peer evaluates its own model after ``--steps`` steps; a configuration's
figure is the mean over the honest peers. After each ``opt.step()`` every honest peer records
whether it has banned each attacker (``robust.banned`` of the peer ids the attackers write to the
work folder); each peer has its own ``DEDLOC_HOME`` and each run its own run id, so every
configuration, run and peer starts with an empty ban table. ``BYZ_DEBUG=1`` logs hivemind's
averaging and optimizer at DEBUG in the peers' logs (``--keep``).

Configurations: ``honest`` (mean aggregation, no attacker), then for each attack ``mean`` and
``centered_clip``; each runs ``--runs`` times (2). ``2of5`` in ``--attacks`` adds a set of its own:
5 peers, peers 3 and 4 attacking, ``2of5-honest`` then ``flip`` and ``reducer-flip`` with both
aggregations. The tables show each run's ratio of eval loss over the honest swarm's of the same
run (``r1/r2``) and the worst, the step at which all honest peers had banned each attacker, and
the failed rounds per honest peer. The last lines: ``byzantine: worst robust/honest X, worst mean/honest
Y`` (worst over the attacks and runs of the first set) and, when it ran, ``byzantine 2of5: ...``.
"""

from __future__ import annotations

import argparse
import json
import math
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

SENDER_ATTACKS = ("nan", "scale", "flip", "noise", "ipm", "alie")
REDUCER_ATTACKS = ("reducer-flip", "reducer-scale", "reducer-shift")
ATTACKS = ("nan", "scale", "flip", "noise", *REDUCER_ATTACKS, "ipm", "alie")
GROUPS = {"reducer": REDUCER_ATTACKS}
TWO_OF_FIVE = "2of5"
TWO_OF_FIVE_ATTACKS = ("flip", "reducer-flip")
ALIE_SAMPLES = 4


def describe(attack: str, args: argparse.Namespace) -> str:
    return {"nan": "all NaN", "scale": "gradient x1000", "flip": "gradient x-10",
            "noise": "Gaussian, gradient's norm", "reducer-flip": "honest; reduces to -10 x avg",
            "reducer-scale": "honest; reduces to 100 x avg", "reducer-shift": "honest; reduces to avg + 1",
            "ipm": f"-{args.ipm_eps:g} x its own gradient",
            "alie": f"mean - {args.alie_z:g} std, {ALIE_SAMPLES} batches"}[attack]


def parse_model(spec: str) -> dict:
    import re

    m = re.fullmatch(r"d(\d+)x(\d+)(?:s(\d+))?", spec)
    if not m:
        raise SystemExit(f"--model: expected e.g. d64x2s32, got {spec!r}")
    return {"d_model": int(m[1]), "n_layers": int(m[2]), "seq_len": int(m[3] or 32), "n_heads": 2,
            "lr": 0.01, "warmup_steps": 0, "dropout": 0.0}


def parse_attacks(spec: str) -> tuple[list[str], bool]:
    """The attacks of the first set (groups expanded, in order) and whether the 2-of-5 set runs."""
    attacks, two_of_five, unknown = [], False, []
    for item in (a.strip() for a in spec.split(",")):
        if not item:
            continue
        if item == TWO_OF_FIVE:
            two_of_five = True
        elif item in GROUPS or item in ATTACKS:
            attacks += [a for a in GROUPS.get(item, (item,)) if a not in attacks]
        else:
            unknown.append(item)
    if unknown or not (attacks or two_of_five):
        known = ", ".join([*ATTACKS, *GROUPS, TWO_OF_FIVE])
        raise SystemExit(f"--attacks: unknown {unknown or 'none given'}; known: {known}")
    return attacks, two_of_five


# ---- the attacker (bench only) -------------------------------------------------------------------


class AlieSamples:
    """The attacker's extra gradients of this step for ``alie``: ``ALIE_SAMPLES - 1`` micro-batches
    from a stream of its own, so that its training data keeps its order."""

    def __init__(self, model, recipe, batches):
        self.model, self.recipe, self.batches = model, recipe, batches
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.grads: list[list] = []

    def draw(self) -> None:
        import torch

        self.grads = []
        for _ in range(ALIE_SAMPLES - 1):
            loss = self.recipe.loss(self.model, next(self.batches))
            self.grads.append([g.detach() for g in torch.autograd.grad(loss, self.params)])


def corrupt_before_averaging(opt, attack: str, seed: int, eps: float = 0.5, z: float = 1.0,
                             alie: AlieSamples | None = None) -> None:
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
            for index, t in enumerate(tensors):
                if attack == "nan":
                    t.fill_(float("nan"))
                elif attack == "scale":
                    t.mul_(1000.0)
                elif attack == "flip":
                    t.mul_(-10.0)
                elif attack == "noise":
                    noise = torch.randn(t.shape, generator=gen, dtype=t.dtype)
                    t.copy_(noise * (t.norm() / noise.norm().clamp_min(1e-12)))
                elif attack == "ipm":
                    t.mul_(-eps)
                elif attack == "alie":
                    if alie is None or len(alie.grads) != ALIE_SAMPLES - 1:
                        raise RuntimeError("alie: the step's extra gradients were not drawn")
                    samples = torch.stack([t.float()] + [g[index].float().reshape(t.shape) for g in alie.grads])
                    t.copy_(samples.mean(0) - z * samples.std(0))
                else:
                    raise ValueError(f"unknown attack {attack!r}")

    averager.load_accumulators_into_averager_ = load_corrupted


def lie_as_reducer(attack: str) -> None:
    """Make this process's reducers return a finite lie for their slice: ``robust.aggregate`` wrapped,
    before hivemind forks the averagers (which inherit it)."""
    from dedloc_core.engine import robust

    true_aggregate = getattr(robust, "aggregate", None)
    if true_aggregate is None:
        raise RuntimeError("dedloc_core.engine.robust.aggregate is missing: the reducer attacks need it")
    lie = {"reducer-flip": lambda avg: avg * -10.0, "reducer-scale": lambda avg: avg * 100.0,
           "reducer-shift": lambda avg: avg + 1.0}[attack]

    def aggregate(parts, weights):
        return lie(true_aggregate(parts, weights))

    robust.aggregate = aggregate


# ---- one peer (a child process) -------------------------------------------------------------------


def finish_step(opt) -> None:
    """Finish a step that ``opt.step()`` left undone. hivemind steps only once its tracker has seen
    the swarm reach the target batch, and the tracker reads the others' reports in the background:
    a peer that calls ``step`` a moment before its next read accumulates its gradient and returns.
    Training would simply go on; here it would wait at the barrier while the others wait for its
    part in the round it had already scheduled, until the round fails for all of them. So it waits
    for its tracker and runs the step's update without accumulating the gradient again."""
    deadline = time.monotonic() + 30
    while not opt.tracker.ready_to_update_epoch and time.monotonic() < deadline:
        time.sleep(0.02)
    opt._update_global_epoch(None)


class Barrier:
    """All ``peers`` peers of a configuration meet here (files in the work folder); a peer that fails
    writes ``abort``, and the others stop waiting. With ``grace``, the honest peers (the first
    ``honest``) wait for the attackers at most that long once they are all there (then 2 s once the
    attackers have missed a barrier): a banned attacker spends a whole matchmaking timeout per step,
    and the honest peers need not. With ``done``, an attacker stops waiting once that file exists
    (the honest peers finished: another attacker may never come). A peer that wrote ``gone``
    (its model diverged) counts as there at every later barrier."""

    def __init__(self, work: Path, name: str, index: int, peers: int, honest: int, grace: float | None = None,
                 done: Path | None = None):
        self.work, self.name, self.index, self.count = work, name, index, 0
        self.peers, self.honest = peers, honest
        self.grace, self.missed, self.done = grace, 0, done

    def wait(self, timeout: float) -> None:
        self.count += 1
        stem = f"{self.name}.b{self.count}"
        (self.work / f"{stem}.{self.index}").touch()
        deadline, honest_since = time.monotonic() + timeout, None
        while not all(self.there(stem, i) for i in range(self.peers)):
            if (self.work / f"{self.name}.abort").exists():
                raise SystemExit("another peer failed")
            if self.done is not None and self.done.exists():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"barrier {self.count}: the other peers did not come")
            if self.grace is not None and all(self.there(stem, i) for i in range(self.honest)):
                honest_since = honest_since or time.monotonic()
                if time.monotonic() - honest_since > (2.0 if self.missed else self.grace):
                    self.missed += 1
                    return
            time.sleep(0.02)

    def there(self, stem: str, index: int) -> bool:
        return (self.work / f"{stem}.{index}").exists() or (self.work / f"{self.name}.gone{index}").exists()

    def leave(self) -> None:
        (self.work / f"{self.name}.gone{self.index}").touch()


def run_peer(args: argparse.Namespace) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s peer%(peer)s %(name)s %(levelname)s %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_Tag(args.index))
    logging.getLogger("dedloc_core").setLevel(logging.INFO)
    if os.environ.get("BYZ_DEBUG"):
        logging.getLogger("hivemind.averaging").setLevel(logging.DEBUG)
        logging.getLogger("hivemind.optim").setLevel(logging.DEBUG)
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


def write_file(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.rename(path)


def peer_main(index: int, conf: dict, args: argparse.Namespace, work: Path) -> dict:
    import torch

    from dedloc_core.engine import bans, robust, swarm
    from dedloc_core.engine.recipes import load_recipe

    peers, honest_peers, attack = conf["peers"], conf["peers"] - conf["attackers"], conf["attack"]
    attacker = attack is not None and index >= honest_peers
    swarm.prepare_process()
    robust.configure(conf["aggregation"], args.radius, args.iterations)  # as the worker does, before forks
    run_id = f"byz_{conf['name']}"
    bans.load(run_id)  # as the worker does: one table shared with the forks (this peer's DEDLOC_HOME)
    if attacker and attack in REDUCER_ATTACKS:
        lie_as_reducer(attack)  # before the averagers fork
    torch.set_num_threads(1)
    torch.manual_seed(1000 + index)
    recipe = load_recipe("tiny-lm", parse_model(args.model))
    model = recipe.build_model(seed=0)
    cfg = swarm.SwarmConfig(run_id=run_id, target_batch_size=args.batch,
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
        write_file(maddrs, json.dumps([str(m) for m in dht.get_visible_maddrs()]))
    if attacker:
        write_file(work / f"attacker{index}.id", str(dht.peer_id))
    opt = swarm.build_optimizer(dht, cfg, model, recipe)
    alie = None
    if attacker and attack in SENDER_ATTACKS:
        if attack == "alie":
            alie = AlieSamples(model, recipe, recipe.batches([], args.batch, seed=300 + index))
        corrupt_before_averaging(opt, attack, seed=7, eps=args.ipm_eps, z=args.alie_z, alie=alie)
    batches = recipe.batches([], args.batch, seed=100 + index)
    honest_done = work / f"{conf['name']}.honest_done"
    barrier = Barrier(work, conf["name"], index, peers, honest_peers, grace=15.0 if attack and not attacker else None,
                      done=honest_done if attacker else None)
    # hivemind averages only once its tracker has seen other peers, and its tracker publishes a
    # peer's record only once it has accumulated samples: report one (the first step's report
    # replaces it), so that the peers see each other before step 1
    opt.tracker.report_local_progress(opt.local_epoch, 1)
    deadline = time.monotonic() + 120
    while opt.tracker.global_progress.num_peers < peers and time.monotonic() < deadline:
        time.sleep(0.2)
    if opt.tracker.global_progress.num_peers < peers:
        raise TimeoutError(f"the tracker sees {opt.tracker.global_progress.num_peers} peers after 120 s")
    barrier.wait(timeout=180)  # everyone joined and sees the others (the attackers wrote their ids)
    attacker_ids = [] if attack is None or attacker else \
        [(work / f"attacker{i}.id").read_text() for i in range(honest_peers, peers)]
    groups, banned, began = [], [], time.monotonic()
    for _ in range(args.steps):
        if attacker and honest_done.exists():
            break  # the honest peers went on without it (banned): nothing left to attack
        loss = recipe.loss(model, next(batches))
        loss.backward()
        if alie is not None:
            alie.draw()
        barrier.wait(timeout=300)
        if attacker and honest_done.exists():
            break
        rounds, epoch = opt.rounds_joined, opt.local_epoch
        opt.step()
        if opt.local_epoch == epoch:
            finish_step(opt)
        opt.zero_grad()
        groups.append(opt.last_group_size if opt.rounds_joined > rounds else 0)  # 0: the round failed
        if attacker_ids:
            banned.append([robust.banned(a) for a in attacker_ids])
        if not attacker and not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            barrier.leave()  # diverged: its eval is inf whatever follows, and each further step would
            break  # cost the others a matchmaking timeout (they banned it for its NaN parts)
    wall = time.monotonic() - began
    if not attacker:
        honest_done.touch()
    late = len(groups) < args.steps  # an attacker the honest peers went on without leaves without meeting
    if not late:
        barrier.wait(timeout=300)  # nobody leaves while others still average
    eval_loss = float("nan") if attacker else recipe.evaluate(model, [], max_batches=args.eval_batches)
    out = dict(eval_loss=eval_loss, epoch=opt.local_epoch, groups=groups, wall=wall, banned=banned,
               digest=swarm.param_digest(model), missed=barrier.missed)
    if not late:
        barrier.wait(timeout=300)
    opt.shutdown()
    dht.shutdown()
    return out


# ---- the parent -----------------------------------------------------------------------------------


def run_config(conf: dict, args: argparse.Namespace, work: Path) -> dict:
    """Run one configuration once: ``conf["name"]`` names this run (its work folder, run id, log)."""
    name, peers = conf["name"], conf["peers"]
    honest_peers = peers - conf["attackers"] if conf["attack"] else peers
    log_path = work / f"{name}.log"
    shared = work / name  # barrier files, addresses, ids, results, each peer's DEDLOC_HOME: fresh
    shutil.rmtree(shared, ignore_errors=True)
    shared.mkdir(parents=True)
    procs = []
    with open(log_path, "w") as log:
        for i in range(peers):
            argv = [sys.executable, __file__, "--peer", "--index", str(i), "--conf", json.dumps(conf),
                    "--work", str(shared), "--steps", str(args.steps), "--model", args.model,
                    "--batch", str(args.batch), "--radius", str(args.radius), "--iterations", str(args.iterations),
                    "--matchmaking-time", str(args.matchmaking_time), "--eval-batches", str(args.eval_batches),
                    "--ipm-eps", str(args.ipm_eps), "--alie-z", str(args.alie_z)]
            env = {**os.environ, "DEDLOC_HOME": str(shared / f"home{i}")}  # a ban table of its own
            procs.append(subprocess.Popen(argv, stdout=log, stderr=log, cwd=ROOT, env=env))
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
    for i in range(peers):
        path = shared / f"{name}.{i}.json"
        got[i] = json.loads(path.read_text()) if path.exists() else {"error": "no result (timed out?)"}
    errors = {i: o["error"] for i, o in got.items() if "error" in o}
    if errors:
        raise SystemExit(f"{name}: peers failed ({errors}); see {log_path}")
    honest = [got[i] for i in range(honest_peers)]
    losses = [o["eval_loss"] for o in honest[:peers - conf["attackers"]]]  # the same peers in every configuration
    banned_at = []  # per attacker: the first step after which every honest peer had banned it, or None
    if conf["attack"]:
        steps = min(len(o["banned"]) for o in honest)
        for j in range(conf["attackers"]):
            banned_at.append(next((k + 1 for k in range(steps) if all(o["banned"][k][j] for o in honest)), None))
    spread = max(losses) - min(losses) if all(math.isfinite(x) for x in losses) else float("nan")
    return dict(name=name, eval_loss=sum(losses) / len(losses), spread=spread,
                full_rounds=sum(g == peers for g in honest[0]["groups"]),
                failed_rounds=[sum(g == 0 for g in o["groups"]) for o in honest],  # per honest peer
                without_attacker=honest[0].get("missed", 0), banned_at=banned_at,
                epochs=[o["epoch"] for o in got.values()], wall=max(o["wall"] for o in got.values()),
                groups=honest[0]["groups"])


def ratio(loss: float, honest: float) -> float:
    """Eval loss over the honest swarm's; ``inf`` when an honest peer's model is not finite (NaN)."""
    return loss / honest if math.isfinite(loss) else float("inf")


def banned_steps(figure: dict) -> str:
    """When the honest peers had all banned each attacker: ``3``, ``never``, ``2,never`` (two attackers)."""
    return ",".join(str(k or "never") for k in figure["banned_at"])


def config_set(prefix: str, peers: int, attackers: int, attacks: list[str]) -> list[dict]:
    """The configurations of one set: its honest baseline, then each attack with both aggregations."""
    label = f"{prefix}-" if prefix else ""
    base = dict(peers=peers, attackers=attackers)
    configs = [dict(base, label=f"{label}honest", attack=None, aggregation="mean")]
    for attack in attacks:
        configs += [dict(base, label=f"{label}{attack}-mean", attack=attack, aggregation="mean"),
                    dict(base, label=f"{label}{attack}-clip", attack=attack, aggregation="centered_clip")]
    return configs


def report_set(prefix: str, peers: int, attackers: int, attacks: list[str], figures: dict,
               args: argparse.Namespace) -> tuple[float, float]:
    """Print a set's tables; return its worst clip/honest and mean/honest ratios."""
    label = f"{prefix}-" if prefix else ""
    honest = [f["eval_loss"] for f in figures[f"{label}honest"]]
    first = peers - attackers
    who = f"peer {first}" if attackers == 1 else f"peers {first}-{peers - 1}"
    print(f"\n{peers} peers ({who} attacking), tiny-lm {args.model}, micro-batch = target batch {args.batch} per "
          f"peer, {args.steps} steps, {args.runs} run(s); centered_clip radius {args.radius}, {args.iterations} "
          f"iterations; honest eval loss {'/'.join(f'{x:.4f}' for x in honest)}")
    print(f"{'attack':14} {'sends':32} {'mean/honest':>14} {'worst':>7} {'clip/honest':>14} {'worst':>7}")
    worst = {"mean": 0.0, "clip": 0.0}
    cells = {}
    for attack in attacks:
        row = []
        for agg in ("mean", "clip"):
            ratios = [ratio(f["eval_loss"], h) for f, h in zip(figures[f"{label}{attack}-{agg}"], honest, strict=True)]
            worst[agg] = max(worst[agg], *ratios)
            row += ["/".join(f"{r:.3f}" for r in ratios), f"{max(ratios):.3f}"]
            runs = figures[f"{label}{attack}-{agg}"]
            cells[attack, agg] = ("/".join(banned_steps(f) for f in runs),
                                  "/".join(",".join(map(str, f["failed_rounds"])) for f in runs))
        print(f"{attack:14} {describe(attack, args):32} {row[0]:>14} {row[1]:>7} {row[2]:>14} {row[3]:>7}")
    print(f"{'attack':14} {'aggregation':14} {'banned at step':24} failed rounds per honest peer")
    for (attack, agg), (banned, failed) in cells.items():
        print(f"{attack:14} {'centered_clip' if agg == 'clip' else 'mean':14} {banned:24} {failed}")
    if any(math.isinf(r) for r in worst.values()):
        print("inf: an honest peer's model ended with NaN or inf")
    if "nan" in attacks:
        print("nan: NaN/inf parts are dropped with mean and centered_clip alike (the product's behaviour);"
              " the sender is banned after 3 drops")
    return worst["clip"], worst["mean"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per configuration")
    ap.add_argument("--runs", type=int, default=None, help="runs of every configuration (default 2; 1 with --quick)")
    ap.add_argument("--attacks", default=",".join([*ATTACKS, TWO_OF_FIVE]),
                    help=f"comma-separated, from {','.join(ATTACKS)}; reducer = the three reducer-*; "
                         f"{TWO_OF_FIVE} = the set with 2 attackers of 5 peers")
    ap.add_argument("--quick", action="store_true", help="10 steps, attacks flip and nan, 1 run (a smoke run)")
    ap.add_argument("--peers", type=int, default=4, help="peers of the first set")
    ap.add_argument("--attackers", type=int, default=1, help="attackers of the first set (the highest indices)")
    ap.add_argument("--ipm-eps", type=float, default=0.5, help="ipm sends -eps x the honest mean's estimate")
    ap.add_argument("--alie-z", type=float, default=1.0, help="alie sends mean - z std")
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
        args.runs = 1 if args.runs is None else args.runs
    args.runs = 2 if args.runs is None else args.runs
    attacks, two_of_five = parse_attacks(args.attacks)
    if args.steps < 1 or args.runs < 1:
        raise SystemExit("--steps and --runs must be at least 1")
    if not 1 <= args.attackers < args.peers:
        raise SystemExit(f"--attackers must be at least 1 and fewer than --peers ({args.peers})")
    if args.alie_z < 0:
        raise SystemExit("--alie-z must not be negative")
    from dedloc_core.catalog.model import Experiment
    from dedloc_core.schema import fields as model_fields

    fields = model_fields(Experiment)
    args.radius = fields["clip_radius"].default if args.radius is None else args.radius
    args.iterations = fields["clip_iterations"].default if args.iterations is None else args.iterations
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="byzantine-bench-"))
    work.mkdir(parents=True, exist_ok=True)

    sets = [("", args.peers, args.attackers, attacks)] if attacks else []
    if two_of_five:
        sets.append((TWO_OF_FIVE, 5, 2, list(TWO_OF_FIVE_ATTACKS)))
    began, figures = time.monotonic(), {}
    for prefix, peers, attackers, set_attacks in sets:
        for run in range(1, args.runs + 1):
            for conf in config_set(prefix, peers, attackers, set_attacks):
                f = run_config(dict(conf, name=f"{conf['label']}-r{run}"), args, work)
                figures.setdefault(conf["label"], []).append(f)
                banned = "" if conf["attack"] is None else f", banned at step {banned_steps(f)}"
                print(f"  {f['name']}: eval loss {f['eval_loss']:.4f} (honest peers within {f['spread']:.4f}), "
                      f"rounds of {peers}: {f['full_rounds']}/{args.steps}, failed per honest peer: "
                      f"{f['failed_rounds']}, steps without the attackers: {f['without_attacker']}{banned}, "
                      f"{f['wall']:.0f} s", flush=True)
    (work / "figures.json").write_text(json.dumps(figures, indent=1))
    print(f"{time.monotonic() - began:.0f} s; logs and figures.json in {work}")
    lines = []
    for prefix, peers, attackers, set_attacks in sets:
        clip, mean = report_set(prefix, peers, attackers, set_attacks, figures, args)
        title = f"byzantine {prefix}" if prefix else "byzantine"
        lines.append(f"{title}: worst robust/honest {clip:.3f}, worst mean/honest {mean:.3f}")
    print()
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
