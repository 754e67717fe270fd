"""Swarm compute utilization over shaped links, in a fair network lab (root, Linux; see tests/netlab).

Profile: a backbone and three volunteers on the lab's public segment, volunteer links shaped
(rate up and down, one-way delay on what each receives): 100 Mbit/s + 20 ms, 50 Mbit/s + 30 ms,
20 Mbit/s + 50 ms (``PROFILE``; ``--volunteers 4`` adds 10 Mbit/s + 50 ms). Every node runs in its
own CPU group with a fixed quota (``--cpu``, default 0.4 of a core each: 2 cores for the five nodes;
0.3 with four volunteers), so a node's solo rate does not depend on how many others train beside it.

Steps, in one run:
1. solo rates: each volunteer's samples/s on the bare training loop (``netlab/solo.py``) in its
   namespace and CPU group, alone, then all together with the reference node (the two agree when
   the quotas hold);
2. pacing: the target batch and matchmaking time from the measured throughput (``engine.pacing``):
   a step lasts ``--headroom`` times an estimated round (fp16 gradients and parameters over the
   slowest link, plus round trips); both columns train that same experiment;
3. each mode (a fresh swarm, a new run id) trains ``tiny-lm`` for ``--steps`` global steps after
   its first one. "hivemind defaults": hivemind.Optimizer's own options (no overlap, no compression,
   no declared bandwidth). "ours": overlap (delayed gradient averaging and optimizer step), fp16
   gradients, DeDLOC load balancing with each volunteer's declared bandwidth, parameters averaged
   every 4th step; its volunteers use the DHT without serving it while the backbone answers (the
   catalog's default ``volunteer_dht: "client"``; ``--volunteer-dht server``: they serve it as
   hivemind's do). Beside each mode a
   reference node (its own CPU group with the same quota, no network) runs the bare loop the whole
   time: the solo rate measured during the column, not minutes away from it.

Micro-batches hold ``--micro-batch`` samples (default 32: about 37 ms of CPU each, 90 ms at a node's 0.4 cores).
What hivemind's optimizer does per micro-batch (count the
samples, add the gradients up, check the swarm's progress) does not grow with a micro-batch's
compute: at 8 samples of 32 tokens through 2 layers it was about 6 % of the loop's CPU
(``bench/accumulate.py``: 7.7 against the bare loop's 7.2 ms), which a real recipe spreads over far
more compute (the shipped demo's micro-batch, 16 x 128 tokens through 4 layers, is at least 16
times 8 x 32 tokens through 2). ``--micro-batch 8`` gives the old figures.

``--lone`` runs one volunteer alone instead (no averaging) and prints its worker's samples/s
against the bare loop's in the same CPU group: the worker's own cost per sample.

Rows, over the window between the first and the last global step:
- swarm samples/s: the samples all volunteers computed (their ``stats`` events) / wall time;
- solo samples/s beside: the reference node's samples per CPU second over the same window, times
  its quota (``reference's cores``: what it used; about 0.40 unless the five nodes' demand met the
  two cores' limit), times the number of volunteers (the nodes are alike: same quota, same loop);
- utilization: swarm / solo beside: what the volunteers computed against what the same nodes compute
  on the bare loop at the same time, so the VM's drift (a tenth within minutes) cancels out;
- solo samples/s before / after: the sum of the volunteers' solo rates (alone) just before the mode
  and just after it; utilization before/after: swarm / their mean (the older reading),
  marked ``*`` when the two differ by more than 10 % (this VM's speed moved so; a run read 1.09
  while the bare loop's rate fell from 820 to 692 samples/s around its column);
- step s: wall time per global step; round s: mean time per averaging round (``averaging_seconds``
  / ``rounds``; includes matchmaking; with overlap it runs beside training);
- bytes/sample: bytes sent on the volunteers' own interfaces (headers included) / samples;
- loop efficiency: samples per CPU second of the training loop (``of which the loop``) against the
  reference loop's samples per CPU second of its quota; utilization = this x the loop's share of
  the quota (``of which the loop`` / ``--cpu``);
- loss @ N samples: the volunteers' mean training loss (EMA) when the swarm had computed N samples
  in all (N: the smaller of the two modes' totals, so both columns are read at the same N);
- failed msgs: "Averaging step failed" messages in the volunteers' logs until the last global step
- goings-on: times a volunteer went on at the swarm's step ("The swarm took step N without us"), same logs
  (not after: the first volunteer stopped leaves the others' last round, which then fails);
- first-step loads: volunteers that missed the swarm's first step and loaded its state instead.
A mode that fails is printed as ``invalid``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from conftest import tiny_experiment  # noqa: E402
from netlab import Lab  # noqa: E402
from netlab.lab import Shape  # noqa: E402
from netlab.peers import Backbone, Peer, Reference, solo_rates, wait_until  # noqa: E402

from dedloc_core.engine import pacing  # noqa: E402

PROFILE = [(100, 20), (50, 30), (20, 50), (10, 50)]  # (Mbit/s, one-way delay ms) per volunteer
STATE_EVERY = 4  # "ours": parameters averaged every 4th step (gradients every step)
MODES = {
    "hivemind defaults": dict(grad_compression="none", overlap=False),
    "ours": dict(grad_compression="fp16", bandwidth=True, overlap=True, average_state_every=STATE_EVERY),
}
RECIPE = {"d_model": 128, "n_layers": 2, "n_heads": 2, "seq_len": 32, "lr": 0.003, "warmup_steps": 0}


MICRO_BATCH = [32]  # samples per micro-batch (--micro-batch)
UNSTEADY = 0.10  # a column whose solo rate moved more than this (after against before) is marked


def experiment(name: str, target_batch: int, matchmaking: float, overlap: bool, state_every: int = 1,
               volunteer_dht: str = "server") -> dict:
    return tiny_experiment(id=f"bench-{len(name)}", run_id=f"bench_{abs(hash(name)) % 10**6}",
                           batch_size_per_step=MICRO_BATCH[0],
                           target_batch_size=target_batch, matchmaking_time=matchmaking, averaging_timeout=30.0,
                           overlap=overlap, average_state_every=state_every, recipe_params=RECIPE,
                           volunteer_dht=volunteer_dht)


def param_count() -> int:
    from dedloc_core.engine.recipes import load_recipe

    return sum(p.numel() for p in load_recipe("tiny-lm", RECIPE).build_model().parameters())


def measure_solo(args, together: bool = True) -> tuple[list[float], list[float] | None]:
    """Step 1: the volunteers' solo rates in their CPU groups, ``(alone, together)``: together with
    the reference node (its rate last); after each mode only alone (``together=False``: None)."""
    exp = experiment("solo", 256, 1.0, False)
    with Lab() as lab:
        hosts = [lab.public(f"s{i}", cpu=args.cpu) for i in range(args.volunteers)]
        alone = solo_rates(lab, hosts, exp, args.solo_seconds)
        both = None
        if together:
            both = solo_rates(lab, [*hosts, lab.public("ref", cpu=args.cpu)], exp, args.solo_seconds, together=True)
    return alone, both


def run_mode(name: str, opts: dict, args, pace: pacing.Pace, folder: Path) -> dict:
    exp = experiment(name, pace.target_batch_size, pace.matchmaking_time, opts["overlap"],
                     args.state_every or opts.get("average_state_every", 1),
                     args.volunteer_dht if opts["overlap"] else "server")
    history: list[tuple[int, float]] = []  # (swarm samples so far, volunteers' mean loss)
    each: dict[str, list] = {}  # per volunteer: (time, local step, loss, parameter digest), as read
    with Lab() as lab:
        reference = Reference(lab, lab.public("ref", cpu=args.cpu), exp)
        bb_host = lab.public("bb", cpu=args.cpu)
        backbone = Backbone(lab, bb_host, exp, folder, "--follow-every", str(args.follow_every))
        ready = backbone.wait_ready()
        peers = []
        for i, (mbit, delay) in enumerate(PROFILE[: args.volunteers]):
            host = lab.public(f"v{i}", Shape(up_mbit=mbit, down_mbit=mbit, delay_ms=delay), cpu=args.cpu)
            fields = {"grad_compression": opts["grad_compression"]}
            if opts.get("bandwidth"):
                fields["bandwidth"] = float(mbit)
            peers.append(Peer(lab, host, folder / f"v{i}").start(exp, ready, seed=i + 1, **fields))

        def note() -> None:
            stats, losses = [p.stats for p in peers], [p.progress[-1].loss for p in peers if p.progress]
            if all(stats) and losses and all(v is not None for v in losses):
                samples = sum(s.samples for s in stats)
                if not history or samples > history[-1][0]:
                    history.append((samples, sum(losses) / len(losses)))
                    for p in peers:
                        last = p.progress[-1]
                        each.setdefault(p.host.name, []).append(
                            (round(time.time(), 2), last.local_epoch, last.loss, last.param_digest[:1]))

        wait_until(peers, lambda: all(p.progress for p in peers) and min(p.step for p in peers) >= 1, 300,
                   "the swarm did not reach its first global step")
        for p in peers:
            if any(not e.fatal for e in p.errors):
                raise RuntimeError(f"{p.host.name}: {p.errors[0].message}")
        first = max(p.step for p in peers)
        base = snapshot(lab, peers, bb_host, reference)
        wait_until(peers, lambda: note() or min(p.step for p in peers) >= first + args.steps, args.timeout,
                   f"{args.steps} global steps did not complete")
        end = snapshot(lab, peers, bb_host, reference)
        last = min(p.step for p in peers)
        logs = "".join(p.log_tail(10**8) for p in peers)  # before the stop: a peer that leaves fails the last round
        failed = logs.count("Averaging step failed") + logs.count("AllreduceException")
        went_on = logs.count("without us: going on")
        loaded = logs.count("first step without us: loading")
        for p in peers:
            p.stop()
        reference.stop()
    if args.keep:
        kept = Path(args.keep) / name.replace(" ", "-")
        shutil.copytree(folder, kept, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.pt", "*.bin", "shards", "cache"))
        (kept / "loss_history.json").write_text(json.dumps(history))  # (swarm samples, mean loss) as read
        (kept / "peer_history.json").write_text(json.dumps(each))
    samples = end["samples"] - base["samples"]
    wall = end["time"] - base["time"]
    cpu = {k: sum(e[k] - b[k] for b, e in zip(base["cpu"], end["cpu"], strict=True)) / len(peers) / wall
           for k in ("worker", "loop", "rest", "p2pd")}
    rounds = end["rounds"] - base["rounds"]
    ref_wall = end["ref"][0] - base["ref"][0]
    ref_cores = (end["ref_cpu"] - base["ref_cpu"]) / ref_wall
    # the reference's rate at its full quota: it may get less while five nodes share two cores
    beside = (end["ref"][1] - base["ref"][1]) / ref_wall * args.cpu / max(ref_cores, args.cpu / 2)
    return {"swarm": samples / wall, "beside": beside * len(peers), "ref_cores": ref_cores,
            "step": wall / max(last - first, 1),
            "round": (end["avg_s"] - base["avg_s"]) / rounds if rounds else float("nan"),
            "bps": (end["tx"] - base["tx"]) / max(samples, 1),
            "bb_bps": (end["bb_rx"] - base["bb_rx"]) / max(samples, 1), "failed": failed, "went_on": went_on,
            "loaded": loaded,
            "history": history,
            "steps": last - first, "cpu": cpu,
            "busy": (end["compute"] - base["compute"]) / len(peers) / wall}


def measure_lone(args, seconds: float = 30.0) -> tuple[float, float]:
    """``--lone``: one volunteer (and the backbone) in the lab, no other peer, so no averaging: its
    worker's samples/s over ``seconds`` of training, against the bare loop's in the same CPU group
    just before. What the worker costs per sample before any round does."""
    exp = experiment("lone", 10**7, 1.0, True, STATE_EVERY)
    with Lab() as lab, tempfile.TemporaryDirectory(prefix="netbench-") as folder:
        host = lab.public("v0", cpu=args.cpu)
        solo = solo_rates(lab, [host], exp, args.solo_seconds)[0]
        backbone = Backbone(lab, lab.public("bb", cpu=args.cpu), exp, Path(folder))
        peer = Peer(lab, host, Path(folder) / "v0").start(exp, backbone.wait_ready(), seed=1,
                                                          grad_compression="fp16", bandwidth=100.0)
        wait_until([peer], lambda: peer.stats is not None and peer.stats.samples >= 40 * MICRO_BATCH[0], 120,
                   "the lone volunteer did not train")
        began, first = time.monotonic(), peer.stats.samples
        time.sleep(seconds)
        peer.drain()
        rate = (peer.stats.samples - first) / (time.monotonic() - began)
        peer.stop()
    return solo, rate


def snapshot(lab: Lab, peers: list[Peer], backbone, reference: Reference) -> dict:
    for p in peers:
        p.drain()
    stats = [p.stats for p in peers]
    if any(s is None for s in stats):
        raise RuntimeError("a volunteer sent no stats")
    return {"time": time.monotonic(), "ref": reference.mark(), "ref_cpu": reference.cpu_seconds(),
            "samples": sum(s.samples for s in stats),
            "rounds": sum(s.rounds for s in stats), "avg_s": sum(s.averaging_seconds for s in stats),
            "tx": sum(lab.counters(p.host)[0] for p in peers), "bb_rx": lab.counters(backbone)[1],
            "cpu": [cpu_by_kind(p) for p in peers], "compute": sum(s.compute_seconds for s in stats)}


def cpu_by_kind(peer: Peer) -> dict[str, float]:
    """CPU seconds so far in a volunteer's CPU group: "worker", its Python processes (the worker, and
    hivemind's DHT and averagers: forked processes, or threads of the worker with
    ``DEDLOC_HELPER_THREADS``), of which "loop" is the worker's main thread (the training loop) and
    "rest" everything else; and "p2pd"."""
    out = {"worker": 0.0, "loop": 0.0, "rest": 0.0, "p2pd": 0.0}
    for pid in (peer.host.cgroup / "cgroup.procs").read_text().split():
        try:
            proc = psutil.Process(int(pid))
            times = proc.cpu_times()
            used = times.user + times.system
            if "p2pd" in proc.name():
                out["p2pd"] += used
                continue
            loop = 0.0
            if proc.pid == peer.worker.pid:  # the main thread's id is the pid
                loop = sum(t.user_time + t.system_time for t in proc.threads() if t.id == proc.pid)
        except psutil.Error:
            continue
        out["worker"] += used
        out["loop"] += loop
        out["rest"] += used - loop
    return out


def loss_at(history: list[tuple[int, float]], samples: int) -> float:
    """The loss when the swarm had computed ``samples`` (linear between the notes around it)."""
    for (s0, l0), (s1, l1) in zip(history, history[1:], strict=False):
        if s0 <= samples <= s1:
            return l0 + (l1 - l0) * (samples - s0) / max(s1 - s0, 1)
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--volunteers", type=int, default=3, choices=(3, 4))
    parser.add_argument("--steps", type=int, default=8, help="global steps measured per mode")
    parser.add_argument("--cpu", type=float, default=0.0,
                        help="each node's CPU quota, in cores (default 0.4; 0.3 with four volunteers: six nodes)")
    parser.add_argument("--headroom", type=float, default=4.0,
                        help="step length / estimated round length (default 4, engine.pacing's)")
    parser.add_argument("--target-batch", type=int, default=0, help="override the paced target batch")
    parser.add_argument("--solo-seconds", type=float, default=6.0)
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds allowed per mode")
    parser.add_argument("--modes", default="", help="comma-separated mode names (default: both)")
    parser.add_argument("--state-every", type=int, default=0, help="override average_state_every of both modes")
    parser.add_argument("--follow-every", type=float, default=30.0, help="the backbone's --follow-every")
    parser.add_argument("--micro-batch", type=int, default=32, help="samples per micro-batch (solo and swarm)")
    parser.add_argument("--volunteer-dht", default="client", choices=("server", "client"),
                        help="the experiment's volunteer_dht in \"ours\"")
    parser.add_argument("--keep", default="", help="copy the nodes' logs here")
    parser.add_argument("--lone", action="store_true", help="only a lone volunteer's worker against its solo loop")
    args = parser.parse_args(argv)
    args.cpu = args.cpu or (0.3 if args.volunteers == 4 else 0.4)  # the nodes' quotas within 2 cores
    MICRO_BATCH[0] = args.micro_batch
    if args.lone:
        solo, rate = measure_lone(args)
        print(f"micro-batch {args.micro_batch}, cpu quota {args.cpu}: solo loop {solo:.1f} samples/s, lone worker "
              f"{rate:.1f} samples/s\nlone worker / solo: {rate / solo:.2f}")
        return 0

    alone, together = measure_solo(args)
    solo_sum = sum(alone)
    profile = PROFILE[: args.volunteers]
    round_est = pacing.round_seconds(param_count(), min(m for m, _ in profile), 2 * max(d for _, d in profile) / 1000)
    pace = pacing.pace(solo_sum, round_est, headroom=args.headroom, multiple=64)
    if args.target_batch:
        pace = pacing.Pace(args.target_batch, pace.matchmaking_time, args.target_batch / solo_sum)
    print("node   cpu quota  solo sps alone  solo sps together")
    for i, (a, t) in enumerate(zip(alone, together or [], strict=False)):
        print(f"v{i}     {args.cpu:9.2f}  {a:14.1f}  {t:17.1f}")
    print(f"ref    {args.cpu:9.2f}  {'':14}  {together[-1]:17.1f}")
    print(f"pacing: swarm solo {solo_sum:.0f} samples/s, estimated round {round_est:.2f} s -> target batch "
          f"{pace.target_batch_size} ({pace.step_seconds:.1f} s a step), matchmaking {pace.matchmaking_time} s",
          flush=True)

    results: dict[str, dict | str] = {}
    before = solo_sum
    for name, opts in MODES.items():
        if args.modes and not any(m.strip() and m.strip() in name for m in args.modes.split(",")):
            continue
        began = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="netbench-") as folder:
            try:
                results[name] = run_mode(name, opts, args, pace, Path(folder))
            except Exception as exc:  # one failed mode is a column, not the end
                results[name] = f"invalid ({str(exc).splitlines()[0][:70]})"
        after = sum(measure_solo(args, together=False)[0])
        if isinstance(results[name], dict):
            results[name]["solo"] = (before, after)
        before = after
        print(f"# {name}: {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)

    valid = {n: r for n, r in results.items() if isinstance(r, dict)}
    common = min((r["history"][-1][0] for r in valid.values() if r["history"]), default=0)
    solo_of = lambda r: sum(r["solo"]) / 2  # noqa: E731 - before and after the mode
    unsteady = lambda r: abs(r["solo"][1] - r["solo"][0]) > UNSTEADY * solo_of(r)  # noqa: E731
    rows = [("swarm samples/s", lambda r: f"{r['swarm']:.1f}"),
            ("solo samples/s beside", lambda r: f"{r['beside']:.0f}"),
            ("  reference's cores", lambda r: f"{r['ref_cores']:.3f}"),
            ("utilization", lambda r: f"{r['swarm'] / r['beside']:.2f}"),
            ("solo before / after", lambda r: f"{r['solo'][0]:.0f} / {r['solo'][1]:.0f}"),
            ("utilization before/after", lambda r: f"{r['swarm'] / solo_of(r):.2f}" + (" *" if unsteady(r) else "")),
            ("step s", lambda r: f"{r['step']:.2f}"),
            ("round s", lambda r: f"{r['round']:.2f}"), ("bytes/sample", lambda r: f"{r['bps']:.0f}"),
            ("  of which to backbone", lambda r: f"{r['bb_bps']:.0f}"),
            ("cores: worker", lambda r: f"{r['cpu']['worker']:.3f}"),
            ("  of which the loop", lambda r: f"{r['cpu']['loop']:.3f}"),
            ("  of which the rest", lambda r: f"{r['cpu']['rest']:.3f}"),
            ("cores: p2pd", lambda r: f"{r['cpu']['p2pd']:.3f}"),
            ("loop in step/batch", lambda r: f"{r['busy']:.2f}"),
            ("loop efficiency", lambda r: f"{r['swarm'] * args.cpu / (r['cpu']['loop'] * r['beside']):.2f}"),
            (f"loss @ {common} samples", lambda r: f"{loss_at(r['history'], common):.4f}"),
            ("failed msgs", lambda r: str(r["failed"])),
            ("goings-on", lambda r: str(r["went_on"])),
            ("first-step loads", lambda r: str(r["loaded"]))]
    print(f"{'':24}" + "".join(f"{n:>20}" for n in results))
    for label, cell in rows:
        print(f"{label:24}" + "".join(f"{cell(r) if isinstance(r, dict) else r[:19]:>20}" for r in results.values()))
    if any(unsteady(r) for r in valid.values()):
        print(f"* the bare loop's rate moved more than {UNSTEADY:.0%} between before and after")
    best = max((r["swarm"] / r["beside"] for r in valid.values()), default=0.0)
    if len(valid) == 2:
        a, b = (loss_at(r["history"], common) for r in valid.values())
        print(f"loss ours / defaults at {common} samples: {b / a:.3f}")
    print(f"best utilization: {best:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
