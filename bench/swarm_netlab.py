"""Swarm compute utilization over shaped links, in the network lab (root, Linux; see tests/netlab).

Profile: a backbone and three volunteers on the lab's public segment, volunteer links shaped
(rate up and down, one-way delay on what each receives): 100 Mbit/s + 20 ms, 50 Mbit/s + 30 ms,
20 Mbit/s + 50 ms (``PROFILE``; ``--volunteers 4`` adds 10 Mbit/s + 50 ms). Each mode starts a
fresh swarm (a new run id) training ``tiny-lm`` and measures ``--steps`` global steps after the
first one. Modes: (a) hivemind defaults (no compression, no declared bandwidth), (b) DeDLOC load
balancing fed with each volunteer's declared bandwidth, (c) that plus fp16 or 8-bit
(``Uniform8BitQuantization``) gradient compression.

How the figures are measured, over the window between the first and the last global step:
- swarm samples/s: the samples all volunteers computed (their ``stats`` events) / wall time;
- solo samples/s: each volunteer's samples / its compute seconds (its training loop's time minus
  the time it spent in averaging rounds: what it would do alone), summed over volunteers, in the
  same run;
- utilization: swarm / solo;
- round s: mean time a volunteer spent per averaging round (``Stats.averaging_seconds`` /
  ``Stats.rounds`` deltas; includes matchmaking);
- bytes/sample: bytes sent on the volunteers' own interfaces (headers included) / samples;
- failed msgs: "Averaging step failed" messages in the volunteers' logs over the whole run (a
  failed round falls back to local gradients).
On a 2-core machine the volunteers share the CPU, so solo rates are those of a loaded machine.
A mode that fails (e.g. 8-bit codecs under NumPy 2 without the fix) is printed as ``invalid``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from conftest import tiny_experiment  # noqa: E402
from netlab import Lab  # noqa: E402
from netlab.lab import Shape  # noqa: E402
from netlab.peers import Backbone, Peer, wait_until  # noqa: E402

PROFILE = [(100, 20), (50, 30), (20, 50), (10, 50)]  # (Mbit/s, one-way delay ms) per volunteer
MODES = {
    "a: hivemind defaults": dict(grad_compression="none"),
    "b: load balancing": dict(grad_compression="none", bandwidth=True),
    "c: lb + fp16": dict(grad_compression="fp16", bandwidth=True),
    "c: lb + 8-bit": dict(grad_compression="8bit", bandwidth=True),
}


def run_mode(name: str, opts: dict, args, folder: Path) -> dict:
    exp = tiny_experiment(id=f"bench-{len(name)}", run_id=f"bench_{abs(hash(name)) % 10**6}",
                          target_batch_size=args.target_batch, averaging_timeout=30.0,
                          recipe_params={"d_model": 128, "n_layers": 2, "n_heads": 2, "seq_len": 32,
                                         "lr": 0.003, "warmup_steps": 0})
    with Lab() as lab:
        backbone = Backbone(lab, lab.public("bb"), exp, folder)
        ready = backbone.wait_ready()
        peers = []
        for i, (mbit, delay) in enumerate(PROFILE[: args.volunteers]):
            host = lab.public(f"v{i}", Shape(up_mbit=mbit, down_mbit=mbit, delay_ms=delay))
            fields = {"grad_compression": opts["grad_compression"]}
            if opts.get("bandwidth"):
                fields["bandwidth"] = float(mbit)
            peers.append(Peer(lab, host, folder / f"v{i}").start(exp, ready, seed=i + 1, **fields))
        wait_until(peers, lambda: all(p.progress for p in peers) and min(p.step for p in peers) >= 1, 300,
                   "the swarm did not reach its first global step")
        for p in peers:
            if any(not e.fatal for e in p.errors):
                raise RuntimeError(f"{p.host.name}: {p.errors[0].message}")
        first = max(p.step for p in peers)
        base = snapshot(lab, peers)
        wait_until(peers, lambda: min(p.step for p in peers) >= first + args.steps, args.timeout,
                   f"{args.steps} global steps did not complete")
        end = snapshot(lab, peers)
        for p in peers:
            p.stop()
        logs = "".join(p.log_tail(10**8) for p in peers)
        if "only 0-dimensional arrays" in logs:
            raise RuntimeError("the codec failed to decode (hivemind's 8-bit codecs under NumPy 2)")
        failed = logs.count("Averaging step failed") + logs.count("AllreduceException")
    samples = end["samples"] - base["samples"]
    wall = end["time"] - base["time"]
    solo = sum((e[0] - b[0]) / max(e[1] - b[1], 1e-9) for b, e in zip(base["per_peer"], end["per_peer"], strict=True))
    rounds = end["rounds"] - base["rounds"]
    swarm_sps = samples / wall
    return {"swarm": swarm_sps, "solo": solo, "util": swarm_sps / solo if solo else 0.0,
            "round": (end["avg_s"] - base["avg_s"]) / rounds if rounds else float("nan"),
            "bps": (end["tx"] - base["tx"]) / max(samples, 1), "failed": failed}


def snapshot(lab: Lab, peers: list[Peer]) -> dict:
    for p in peers:
        p.drain()
    stats = [p.stats for p in peers]
    if any(s is None for s in stats):
        raise RuntimeError("a volunteer sent no stats")
    return {"time": time.monotonic(), "samples": sum(s.samples for s in stats),
            "per_peer": [(s.samples, s.compute_seconds - s.averaging_seconds) for s in stats],
            "rounds": sum(s.rounds for s in stats), "avg_s": sum(s.averaging_seconds for s in stats),
            "tx": sum(lab.counters(p.host)[0] for p in peers)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--volunteers", type=int, default=3, choices=(3, 4))
    parser.add_argument("--steps", type=int, default=3, help="global steps measured per mode")
    parser.add_argument("--target-batch", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds allowed per mode")
    parser.add_argument("--modes", default="", help="comma-separated mode letters/names (default: all)")
    args = parser.parse_args(argv)
    results: dict[str, dict | str] = {}
    for name, opts in MODES.items():
        if args.modes and not any(m.strip() and m.strip() in name for m in args.modes.split(",")):
            continue
        began = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="netbench-") as folder:
            try:
                results[name] = run_mode(name, opts, args, Path(folder))
            except Exception as exc:  # noqa: BLE001 - one failed mode is a row, not the end
                results[name] = f"invalid ({str(exc).splitlines()[0][:70]})"
        print(f"# {name}: {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    print(f"{'mode':22} {'swarm sps':>10} {'solo sps':>10} {'util':>6} {'round s':>8} {'bytes/sample':>13}"
          f" {'failed msgs':>11}")
    best = 0.0
    for name, r in results.items():
        if isinstance(r, str):
            print(f"{name:22} {r}")
            continue
        best = max(best, r["util"])
        print(f"{name:22} {r['swarm']:10.1f} {r['solo']:10.1f} {r['util']:6.2f} {r['round']:8.2f} {r['bps']:13.0f}"
              f" {r['failed']:11d}")
    print(f"best utilization: {best:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
