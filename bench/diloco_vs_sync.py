"""DiLoCo against synchronous DeDLOC training: bytes per sample, final eval loss, wall time, utilization.

    .venv/bin/python bench/diloco_vs_sync.py [--peers 2] [--rounds 3] [--model d64x2s32]
        [--sync-target-batch 256] [--inner-steps 100] [--compression 8bit] [--outer-lr 1.0]
        [--outer-momentum 0] [--modes sync,diloco] [--lab swarm]

Two phases, one after the other, each with ``--peers`` real peers (separate processes: real
hivemind, real p2pd) training tiny-lm on the shipped corpus, the same number of samples per peer:

- ``sync``: hivemind.Optimizer as the worker builds it: micro-batches of ``--batch`` accumulated
  until the swarm reaches ``--sync-target-batch``, then fp16 gradients averaged.
- ``diloco``: ``dedloc_core.engine.diloco``; an inner step is this peer's share of the sync global batch
  (``sync_target_batch / peers`` samples), ``--inner-steps`` (H) of them per round, deltas averaged
  with ``--compression``, applied by the outer SGD (``--outer-lr``, ``--outer-momentum``; default:
  the catalog's DilocoParams). Peers train ``--rounds`` rounds; that sets the samples for both
  phases. ``--modes diloco`` runs one phase only (no ratios).

Each peer reports, once it has trained the samples (in DiLoCo mode, once its last sync has been
applied): the eval loss of its model (the outer model in DiLoCo mode) on the shipped eval text,
bytes sent while training (``hivemind_ext.traffic`` from the common start, after every peer
joined and loaded the state: everything this peer put on the wire, DHT and matchmaking included),
wall time and compute time (forward + backward; the optimizer step is left out because in sync mode
it contains the blocking all-reduce), which over wall time is the compute utilization. Peers keep
training until all have reported.

The last line: ``bytes per sample ratio sync/diloco: X, loss diloco/sync: Y``.

Network: peers talk over loopback by default. ``--lab swarm`` (root) runs each peer inside its own
namespace of the network lab (tests/netlab) behind a shaped link: the profile of
bench/swarm_netlab.py (100, 50, 20, 10 Mbit/s with 20, 30, 50, 50 ms one-way delay), the first
``--peers`` links, the same links for both phases.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parse_model(spec: str) -> dict:
    import re

    m = re.fullmatch(r"d(\d+)x(\d+)(?:s(\d+))?", spec)
    if not m:
        raise SystemExit(f"--model: expected e.g. d64x2s32, got {spec!r}")
    return {"d_model": int(m[1]), "n_layers": int(m[2]), "seq_len": int(m[3] or 32), "n_heads": 2,
            "lr": 0.01, "warmup_steps": 0}


# ---- one peer (a child process) -------------------------------------------------------------------


def run_peer(args: argparse.Namespace) -> None:
    import torch

    from dedloc_core.catalog import DilocoParams
    from dedloc_core.engine import hivemind_ext, swarm
    from dedloc_core.engine.recipes import load_recipe

    swarm.prepare_process()
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("dedloc_core").setLevel(logging.INFO)  # DiLoCo rounds: how each ended
    torch.set_num_threads(1)
    recipe = load_recipe("tiny-lm", parse_model(args.model))
    model = recipe.build_model(seed=0)
    initial = json.loads(Path(args.initial).read_text()) if args.initial else []
    cfg = swarm.SwarmConfig(run_id=f"bench_{args.mode}", target_batch_size=args.sync_target_batch,
                            batch_size_per_step=args.batch, initial_peers=initial,
                            host_maddrs=[listen_address(args.lab)], matchmaking_time=args.matchmaking_time,
                            averaging_timeout=30.0)
    dht = swarm.start_dht(cfg)
    Path(args.out + ".maddrs").write_text(json.dumps([str(m) for m in dht.get_visible_maddrs()]))
    if args.mode == "sync":
        opt = swarm.build_optimizer(dht, cfg, model, recipe)
    else:
        from dedloc_core.engine.diloco import DilocoOptimizer

        params = DilocoParams(inner_steps=args.inner_steps, compression=args.compression, outer_lr=args.outer_lr,
                              outer_momentum=args.outer_momentum, resync_every=args.resync_every)
        opt = DilocoOptimizer(dht, cfg.run_id, model, recipe, params, batch_size=args.batch,
                              matchmaking_time=cfg.matchmaking_time, averaging_timeout=cfg.averaging_timeout)
    batches = recipe.batches([], args.batch, seed=args.seed)
    Path(args.out + ".ready").touch()
    go, stop = Path(args.stop + ".go"), Path(args.stop)
    while not go.exists():  # start together, so nobody trains alone at first
        time.sleep(0.1)
    sent0, received0 = hivemind_ext.traffic()  # joining (state download) is not training traffic
    samples, compute, began, reported = 0, 0.0, time.monotonic(), False
    shown = began
    while not stop.exists():
        t0 = time.perf_counter()
        loss = recipe.loss(model, next(batches))
        loss.backward()
        compute += time.perf_counter() - t0  # sync's opt.step() includes the all-reduce: not compute
        opt.step()
        opt.zero_grad()
        samples += args.batch
        if time.monotonic() - shown > 20:
            shown = time.monotonic()
            print(f"{args.mode}: {samples} samples, round {opt.local_epoch}", flush=True)
        if samples >= args.samples and not reported:
            reported = True
            wall = time.monotonic() - began
            sent, received = hivemind_ext.traffic()
            if args.mode == "diloco":  # wait for the last sync, evaluate the outer model the swarm agrees on
                while True:  # finish the running sync, a resync, and any round that is due; no more inner steps
                    if opt._resync is not None:
                        if opt._resync.done():
                            opt._finish_resync()
                        time.sleep(0.05)
                    elif opt._sync is not None:
                        if opt._sync.done():
                            opt._finish_sync()
                        time.sleep(0.05)
                    elif opt.inner_steps >= opt.cfg.inner_steps:
                        opt._launch_sync()
                    else:
                        break
                wall = time.monotonic() - began
                sent, received = hivemind_ext.traffic()
                local = [p.detach().clone() for p in opt.params]
                with torch.no_grad():
                    for p, o in zip(opt.params, opt.outer_params, strict=True):
                        p.copy_(o)
                eval_loss = recipe.evaluate(model, [])
                digest = opt.outer_digest()
                with torch.no_grad():
                    for p, x in zip(opt.params, local, strict=True):
                        p.copy_(x)
            else:
                eval_loss = recipe.evaluate(model, [])
                digest = []
            Path(args.out).write_text(json.dumps(dict(
                samples=samples, eval_loss=eval_loss, bytes_sent=sent - sent0, bytes_received=received - received0,
                wall=wall,
                compute=compute, rounds=opt.local_epoch, outer_digest=digest)))
    opt.shutdown()
    dht.shutdown()


# ---- the network-lab hook ---------------------------------------------------------------------------


def listen_address(lab: str | None) -> str:
    """Where a peer listens: loopback, or (in the lab) its namespace's address."""
    return "/ip4/127.0.0.1/tcp/0" if not lab else "/ip4/0.0.0.0/tcp/0"


PROFILES = {  # (Mbit/s both ways, one-way delay ms) per peer; "swarm" is bench/swarm_netlab.py's
    "swarm": [(100, 20), (50, 30), (20, 50), (10, 50)],
}
_lab_hosts: list = []  # the lab's hosts, one per peer, while a --lab run is under way


def peer_command(argv: list[str], index: int, lab: str | None) -> list[str]:
    """The command that starts peer ``index``: as is, or inside its namespace behind a shaped link."""
    if not lab:
        return argv
    return ["ip", "netns", "exec", _lab_hosts[index].ns] + argv


@contextlib.contextmanager
def network(args: argparse.Namespace):
    """Loopback, or the network lab (tests/netlab; root): each peer a public host behind its own
    shaped link from ``PROFILES[args.lab]``, the same for both phases."""
    if not args.lab:
        yield
        return
    if args.lab not in PROFILES:
        raise SystemExit(f"--lab: unknown profile {args.lab!r}; known: {', '.join(PROFILES)}")
    if args.peers > len(PROFILES[args.lab]):
        raise SystemExit(f"--lab {args.lab} has links for {len(PROFILES[args.lab])} peers")
    sys.path.insert(0, str(ROOT / "tests"))
    from netlab import Lab, lab_unavailable_reason
    from netlab.lab import Shape

    reason = lab_unavailable_reason()
    if reason:
        raise SystemExit(f"--lab: {reason}")
    with Lab() as lab:
        _lab_hosts[:] = [lab.public(f"d{i}", Shape(up_mbit=mbit, down_mbit=mbit, delay_ms=delay))
                         for i, (mbit, delay) in enumerate(PROFILES[args.lab][:args.peers])]
        try:
            yield
        finally:
            _lab_hosts.clear()


# ---- the parent ---------------------------------------------------------------------------------------


def run_phase(mode: str, args: argparse.Namespace, work: Path) -> list[dict]:
    stop = work / f"{mode}.stop"
    procs, outs = [], []
    batch = args.batch if mode == "sync" else args.sync_target_batch // args.peers
    for i in range(args.peers):
        out = work / f"{mode}-{i}.json"
        argv = [sys.executable, __file__, "--peer", "--mode", mode, "--out", str(out), "--stop", str(stop),
                "--seed", str(i + 1), "--model", args.model, "--batch", str(batch),
                "--samples", str(args.samples), "--sync-target-batch", str(args.sync_target_batch),
                "--inner-steps", str(args.inner_steps), "--compression", args.compression,
                "--matchmaking-time", str(args.matchmaking_time), "--outer-lr", str(args.outer_lr),
                "--outer-momentum", str(args.outer_momentum), "--resync-every", str(args.resync_every)]
        if args.lab:
            argv += ["--lab", args.lab]
        if i:
            argv += ["--initial", str(work / f"{mode}-0.json.maddrs")]
        log = open(work / f"{mode}-{i}.log", "w")  # closed with the phase
        procs.append((subprocess.Popen(peer_command(argv, i, args.lab), stdout=log, stderr=log, cwd=ROOT), log))
        outs.append(out)
        if i == 0:
            wait_for(lambda: (work / f"{mode}-0.json.maddrs").exists() or procs[0][0].poll() is not None, 120)
    try:
        wait_for(lambda: all(Path(f"{o}.ready").exists() for o in outs) or any(p.poll() is not None for p, _ in procs),
                 300)
        time.sleep(3)  # let the DHT records of every peer spread
        Path(f"{stop}.go").touch()
        wait_for(lambda: all(o.exists() for o in outs) or any(p.poll() is not None for p, _ in procs),
                 args.timeout)
    finally:
        stop.touch()
        for proc, log in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
    missing = [str(o) for o in outs if not o.exists()]
    if missing:
        raise SystemExit(f"{mode}: no result from {missing}; see the logs in {work}")
    return [json.loads(o.read_text()) for o in outs]


def wait_for(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not condition():
        time.sleep(0.5)


def summarize(results: list[dict]) -> dict:
    samples = sum(r["samples"] for r in results)
    return dict(
        eval_loss=sum(r["eval_loss"] for r in results) / len(results),
        bytes_per_sample=sum(r["bytes_sent"] for r in results) / samples,
        wall=max(r["wall"] for r in results),
        utilization=sum(r["compute"] / r["wall"] for r in results) / len(results),
        rounds=max(r["rounds"] for r in results),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="DiLoCo rounds (sets the samples per peer)")
    ap.add_argument("--model", default="d64x2s32")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--sync-target-batch", type=int, default=256)
    ap.add_argument("--inner-steps", type=int, default=100)
    ap.add_argument("--samples", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--compression", default="8bit", choices=["none", "fp16", "8bit", "4bit"])
    ap.add_argument("--outer-lr", type=float, default=None, help="DiLoCo outer lr (default: the catalog's)")
    ap.add_argument("--outer-momentum", type=float, default=None,
                    help="DiLoCo outer Nesterov momentum, 0 for none (default: the catalog's)")
    ap.add_argument("--resync-every", type=int, default=None,
                    help="DiLoCo rounds between outer-model resyncs, 0 for none (default: the catalog's)")
    ap.add_argument("--modes", default="sync,diloco", help="phases to run (both for the ratios)")
    ap.add_argument("--matchmaking-time", type=float, default=1.0, help="seconds, both modes")
    ap.add_argument("--lab", default=None, help="network-lab link profile: swarm (root; tests/netlab)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--keep", default=None, help="keep peer logs in this folder")
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--stop", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--initial", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    from dedloc_core.catalog import DilocoParams

    defaults = DilocoParams()
    args.outer_lr = defaults.outer_lr if args.outer_lr is None else args.outer_lr
    args.outer_momentum = defaults.outer_momentum if args.outer_momentum is None else args.outer_momentum
    args.resync_every = defaults.resync_every if args.resync_every is None else args.resync_every
    if args.peer:
        run_peer(args)
        return
    if args.sync_target_batch % (args.peers * args.batch):
        raise SystemExit("--sync-target-batch must be a multiple of peers x batch")
    args.samples = args.rounds * args.inner_steps * (args.sync_target_batch // args.peers)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="diloco-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DEDLOC_HOME", str(work / "home"))
    with network(args):
        results = {mode: run_phase(mode, args, work) for mode in args.modes.split(",")}
    figures = {mode: summarize(r) for mode, r in results.items()}
    print(f"{args.peers} peers, {args.samples} samples each, model {args.model}; sync: micro-batch {args.batch}, "
          f"target batch {args.sync_target_batch}, fp16 gradients; diloco: inner batch "
          f"{args.sync_target_batch // args.peers}, H={args.inner_steps}, {args.compression} deltas, "
          f"{args.rounds} rounds, outer lr {args.outer_lr} momentum {args.outer_momentum}, "
          f"resync every {args.resync_every}; "
          f"network: {args.lab or 'loopback'}")
    print(f"{'mode':8} {'eval loss':>10} {'bytes/sample':>13} {'wall s':>8} {'compute util':>13} {'rounds':>7}")
    for mode, f in figures.items():
        print(f"{mode:8} {f['eval_loss']:10.4f} {f['bytes_per_sample']:13.1f} {f['wall']:8.1f} "
              f"{f['utilization']:13.3f} {f['rounds']:7d}")
    if "diloco" in results:  # every peer evaluates its own outer model: they should be (nearly) the same
        print("diloco per-peer eval loss:", ", ".join(f"{r['eval_loss']:.4f}" for r in results["diloco"]),
              "| outer digests:", "; ".join(",".join(f"{x:.4g}" for x in r["outer_digest"]) for r in results["diloco"]))
    if set(figures) != {"sync", "diloco"}:
        return
    ratio = figures["sync"]["bytes_per_sample"] / figures["diloco"]["bytes_per_sample"]
    loss = figures["diloco"]["eval_loss"] / figures["sync"]["eval_loss"]
    print(f"bytes per sample ratio sync/diloco: {ratio:.1f}, loss diloco/sync: {loss:.3f}")


if __name__ == "__main__":
    main()
