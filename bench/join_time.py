"""Joining in seconds: from a volunteer's process start to its first samples counted in a round.

Three cases, each a fresh ``dedloc worker`` process (``WorkerProcess``: the command the app runs),
all training the shipped demo experiment's model (tiny-lm d128x4, seq 128; batch 16, target 256):

1. **alone, no peers**: the shipped demo as a new user joins it, nobody else, on this machine's
   loopback (the corpus served over HTTP on 127.0.0.1 as the app does). Times to "training" and to
   its first samples (the first progress event with samples accumulated).
2. **lone first volunteer** in the network lab (root, Linux; see tests/netlab): a backbone and this
   one volunteer (100 Mbit/s, 20 ms); the same two times.
3. **newcomer to a running swarm**: a second volunteer (50 Mbit/s, 30 ms) joins the first, the two
   train until the swarm is ``--steps`` global steps in (so the state to load is not the initial
   one), then a third starts on a 20 Mbit/s, 50 ms link. Times to "training", to the swarm's step
   (its state loaded), and to its first samples counted in a round (its first ``stats`` event with
   ``rounds`` >= 1: its gradients went into an all-reduce with the others).

Cases 2 and 3 run in a fair lab: each node in its own CPU group with a fixed quota (``--cpu`` for
the volunteers already in the swarm, 0.5 cores each by default; ``--new-cpu`` 0.8 for the newcomer;
``--backbone-cpu`` 0.2; 2 cores in all), so that the newcomer's start is not slowed by the other
volunteers' training, which in the world runs on their own computers (0: no quota).

The bound for case 3 is ``2 x state bytes / link rate + 5 s``: the state is what a newcomer loads
from the swarm (parameters and optimizer state, fp32, as hivemind's state averager sends them),
the link rate the newcomer's download rate. The table also shows the bytes the newcomer received
until then, each worker's own account of its start (its "Ready to train" log line: imports,
data, model, swarm, optimizer), the rounds that had failed in the swarm before the newcomer came,
and when the swarm took its next steps (its phase). Last line: ``join seconds: X, bound: B`` (case 3).

    python bench/join_time.py [--steps 2] [--keep DIR] [--after 40] [--cpu 0.5 --new-cpu 0.8 --backbone-cpu 0.2]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from netlab import Lab  # noqa: E402
from netlab.lab import Shape  # noqa: E402
from netlab.peers import Backbone, Peer, wait_until  # noqa: E402
from swarmpeer import SwarmPeer  # noqa: E402

from dedloc_core.protocol import Limits, Start  # noqa: E402
from dedloc_core.workerproc import WorkerProcess  # noqa: E402

PROFILE = {"v0": (100, 20), "v1": (50, 30), "new": (20, 50)}  # (Mbit/s, one-way delay ms)


def demo_experiment(**overrides) -> dict:
    """The shipped catalog's demo experiment (its signed payload, as the app reads it)."""
    signed = json.loads(resources.files("resources").joinpath("catalog", "default.json").read_text())
    exp = next(e for e in json.loads(signed["payload"])["experiments"] if e["id"] == "tiny-lm-demo")
    return {**exp, **overrides}


def state_bytes(exp: dict) -> int:
    """Bytes of the state a newcomer loads: parameters and optimizer state tensors, fp32."""
    import torch

    from dedloc_core.engine.recipes import load_recipe

    recipe = load_recipe(exp["recipe"], exp["recipe_params"])
    model = recipe.build_model(seed=0)
    opt = recipe.build_optimizer(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # materialize the optimizer's state
    tensors = list(model.parameters()) + [t for s in opt.state.values() for t in s.values()
                                          if isinstance(t, torch.Tensor)]
    return sum(t.numel() * 4 for t in tensors)


class Timer:
    """When a peer first said what: ``training``, first samples, the swarm's step, a round."""

    def __init__(self, peer: Peer, began: float):
        self.peer, self.began, self.seen = peer, began, {}
        self._n = (0, 0)

    def poll(self, swarm_step: int | None = None) -> None:
        p = self.peer
        p.drain()
        now = time.monotonic() - self.began
        states, progress = p.states[self._n[0]:], p.progress[self._n[1]:]
        self._n = (len(p.states), len(p.progress))
        if any(s.state == "training" for s in states):
            self.seen.setdefault("training", now)
        if any(e.samples_accumulated > 0 or e.local_epoch > 0 for e in progress):
            self.seen.setdefault("samples", now)
        if swarm_step is not None and p.step >= swarm_step and progress:
            self.seen.setdefault("synced", now)
        if p.stats is not None and p.stats.rounds >= 1:
            self.seen.setdefault("round", now)

    def get(self, key: str) -> float | None:
        return self.seen.get(key)


def ready_line(log: Path) -> str:
    """The worker's own breakdown ("Ready to train ..."), shortened."""
    try:
        m = re.search(r"Ready to train (.*)", log.read_text())
    except OSError:
        return "?"
    return m.group(1).replace(" after the process started", "") if m else "?"


def wait_for(timer: Timer, key: str, timeout: float, swarm_step: int | None = None, others=(),
             steps: dict[int, float] | None = None) -> None:
    """Poll until ``timer`` has seen ``key``; ``steps`` gets when (timer's clock) ``others`` first
    reported each global step."""
    deadline = time.monotonic() + timeout
    while timer.get(key) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{timer.peer.name}: no '{key}' within {timeout} s\n{timer.peer.describe()}")
        fatal = [e for e in timer.peer.errors if e.fatal]
        if fatal:
            raise RuntimeError(f"{timer.peer.name}: {fatal[0].title}: {fatal[0].message}")
        timer.poll(swarm_step)
        for other in others:
            other.drain()
        if steps is not None and others:
            steps.setdefault(max(o.step for o in others), time.monotonic() - timer.began)
        time.sleep(0.05)


def alone(folder: Path) -> dict:
    """Case 1: the shipped demo, no peers, loopback."""
    from dedloc_core.organizer.httpserve import FileServer

    home = folder / "alone"
    home.mkdir(parents=True)
    server = FileServer()
    server.serve_dir("/data/", Path(str(resources.files("resources").joinpath("corpus"))))
    server.start()
    worker = WorkerProcess(env={**os.environ, "DEDLOC_HOME": str(home), "DEDLOC_LOG_LEVEL": "INFO"},
                           stderr=(home / "worker.log").open("w"))
    peer = SwarmPeer(worker)
    peer.name = "alone"
    began = time.monotonic()
    try:
        worker.start(hello_timeout=120)
        worker.send(Start(experiment=demo_experiment(), initial_peers=[], host_maddrs=["/ip4/0.0.0.0/tcp/0"],
                          data_base_url=server.url, identity_path=str(home / "identity.key"),
                          progress_period=0.5, limits=Limits(cpu_threads=1)))
        timer = Timer(peer, began)
        wait_for(timer, "samples", 180)
    finally:
        worker.stop(timeout=15)
        server.stop()
    return {"training": timer.get("training"), "samples": timer.get("samples"),
            "ready": ready_line(home / "worker.log")}


def after_join(peers: list[Peer], seconds: float) -> dict[str, tuple[float, int, int]]:
    """Each volunteer's (samples/s, rounds, steps) over ``seconds`` of training once the newcomer's
    first round is done: a peer whose rounds lag the swarm's waits for them and trains slower."""
    def totals():
        for p in peers:
            p.drain()
        return {p.name: (p.stats.samples if p.stats else 0, p.rounds, p.step) for p in peers}
    first, began = totals(), time.monotonic()
    time.sleep(seconds)
    last, wall = totals(), time.monotonic() - began
    return {name: ((last[name][0] - first[name][0]) / wall, last[name][1] - first[name][1],
                   last[name][2] - first[name][2]) for name in first}


def in_lab(folder: Path, steps: int, timeout: float, cpu: dict[str, float | None], after: float = 0.0) -> dict:
    """Cases 2 and 3, in one lab: the lone first volunteer, then a newcomer to the swarm it is in.
    ``cpu``: each node's CPU quota in cores (None: no quota); ``after``: seconds of ``after_join``."""
    exp = demo_experiment(id="join-bench", run_id=f"join_bench_{os.getpid()}")
    out: dict = {}
    with Lab() as lab:
        backbone = Backbone(lab, lab.public("bb", cpu=cpu["bb"]), exp, folder)
        ready = backbone.wait_ready()
        hosts = {name: lab.public(name, Shape(up_mbit=m, down_mbit=m, delay_ms=d), cpu=cpu[name])
                 for name, (m, d) in PROFILE.items()}
        peers: list[Peer] = []
        try:
            v0 = Peer(lab, hosts["v0"], folder / "v0")
            peers.append(v0)
            t0 = Timer(v0, time.monotonic())
            v0.start(exp, ready, seed=1)
            wait_for(t0, "samples", timeout)
            out["lone"] = {"training": t0.get("training"), "samples": t0.get("samples"),
                           "ready": ready_line(v0.home / "worker.log")}
            v1 = Peer(lab, hosts["v1"], folder / "v1").start(exp, ready, seed=2)
            peers.append(v1)
            wait_until(peers, lambda: min(p.step for p in peers) >= steps and all(p.rounds for p in peers), timeout,
                       f"the swarm of two did not reach step {steps}")
            swarm_step = max(p.step for p in peers)
            failed = {p.name: p.stats.rounds_failed if p.stats else 0 for p in peers}
            new = Peer(lab, hosts["new"], folder / "new")
            rx0 = lab.counters(hosts["new"])[1]
            tn = Timer(new, time.monotonic())
            new.start(exp, ready, seed=3)
            peers.append(new)
            steps: dict[int, float] = {}
            wait_for(tn, "round", timeout, swarm_step, others=peers[:2], steps=steps)
            out["newcomer"] = {"training": tn.get("training"), "samples": tn.get("samples"),
                               "synced": tn.get("synced"), "round": tn.get("round"), "swarm_step": swarm_step,
                               "rx": lab.counters(hosts["new"])[1] - rx0, "ready": ready_line(new.home / "worker.log"),
                               "steps": steps, "failed_before": failed}
            if after > 0:
                out["after"] = after_join(peers, after)
        finally:
            for p in peers:
                p.stop()
    return out


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="global steps the swarm takes before the newcomer")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per wait")
    parser.add_argument("--keep", type=Path, default=None, help="keep the workers' logs in this folder")
    parser.add_argument("--skip-alone", action="store_true", help="only the lab cases")
    parser.add_argument("--cpu", type=float, default=0.5,
                        help="CPU quota of each volunteer already in the swarm, in cores (0: none)")
    parser.add_argument("--new-cpu", type=float, default=0.8, help="the newcomer's CPU quota, in cores (0: none)")
    parser.add_argument("--after", type=float, default=0.0,
                        help="then train on this many seconds and print each volunteer's samples/s")
    parser.add_argument("--backbone-cpu", type=float, default=0.2, help="the backbone's CPU quota (0: none)")
    args = parser.parse_args(argv)
    cpu = {"bb": args.backbone_cpu or None, "v0": args.cpu or None, "v1": args.cpu or None,
           "new": args.new_cpu or None}
    exp = demo_experiment()
    size = state_bytes(exp)
    rate = PROFILE["new"][0] * 1e6 / 8
    bound = 2 * size / rate + 5.0
    with tempfile.TemporaryDirectory(prefix="joinbench-") as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        first = None if args.skip_alone else alone(folder)
        lab = in_lab(folder, args.steps, args.timeout, cpu, args.after)
    print(f"state: {size / 1e6:.2f} MB (parameters + optimizer state, fp32); newcomer link {PROFILE['new'][0]} Mbit/s,"
          f" {PROFILE['new'][1]} ms")
    print("cpu quotas (cores): " + ", ".join(f"{k} {v if v else 'none'}" for k, v in cpu.items()))
    print(f"{'case':34} {'training s':>10} {'samples s':>10} {'synced s':>9} {'round s':>8}  worker's account")
    if first:
        print(f"{'alone, no peers (shipped demo)':34} {fmt(first['training']):>10} {fmt(first['samples']):>10}"
              f" {'-':>9} {'-':>8}  {first['ready']}")
    lone = lab["lone"]
    print(f"{'lab: lone first volunteer':34} {fmt(lone['training']):>10} {fmt(lone['samples']):>10} {'-':>9} {'-':>8}"
          f"  {lone['ready']}")
    new = lab["newcomer"]
    print(f"{'lab: newcomer (swarm at step ' + str(new['swarm_step']) + ')':34} {fmt(new['training']):>10}"
          f" {fmt(new['samples']):>10} {fmt(new['synced']):>9} {fmt(new['round']):>8}  {new['ready']}")
    print(f"newcomer received {new['rx'] / 1e6:.2f} MB until its first round")
    print("rounds failed before the newcomer started: "
          + ", ".join(f"{name} {n}" for name, n in new["failed_before"].items()))
    later = {step: t for step, t in new["steps"].items() if step > new["swarm_step"]}
    print("the swarm's steps after the newcomer started, s: "
          + (", ".join(f"{step} at {t:.1f}" for step, t in sorted(later.items())) or "none")
          + " (a step's round forms about 1 s before it)")
    for name, (rate, rounds, steps) in lab.get("after", {}).items():
        print(f"after the join, {args.after:.0f} s: {name} {rate:.1f} samples/s ({rate / cpu[name]:.1f} per core),"
              f" {rounds} rounds in {steps} steps" if cpu[name] else f"after the join: {name} {rate:.1f} samples/s")
    print(f"join seconds: {new['round']:.1f}, bound: {bound:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
