"""What verified reduction (hivemind_ext.verified_reduce) costs per round: time and bytes.

    PYTHONPATH=. .venv/bin/python bench/verify_cost.py [--peers 4] [--sizes 1e5,1e6,4e6] [--rounds 6]

``--peers`` real hivemind averagers on loopback (each its own DHT and p2pd, centered_clip, fp16 as
the worker's gradients) average random tensors of each size, ``--rounds`` rounds with the check and
as many without it, alternating so that both see the same machine. Per size it prints the median
round time of each, and the bytes of claims one peer receives per round (from the claims'
layout: ``reducer_check.ROW`` float64 values per row) beside the bytes it sends in the all-reduce
(its parts at 2 bytes a value, less its own share). Last line:
``verify_cost: peers N, size S, round +X ms (+Y %), claims Z KB per peer per round (W % of the all-reduce)``
for the largest size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PEERS = """
import json, sys, time
import torch, hivemind
from hivemind.compression import Float16Compression
from dedloc_core.engine import hivemind_ext, robust
peers, size, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
hivemind_ext.install()
first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
dhts = [first] + [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                               initial_peers=[str(a) for a in first.get_visible_maddrs()]) for _ in range(peers - 1)]
out = {}
for check in (True, False):
    robust.configure("centered_clip", verify=check)  # the averagers fork below and inherit it
    averagers = [hivemind.averaging.DecentralizedAverager(
        [torch.randn(size, generator=torch.Generator().manual_seed(i))], dht=d, prefix=f"cost{check}",
        target_group_size=peers, min_matchmaking_time=1.0, request_timeout=1.0, compression=Float16Compression(),
        start=True) for i, d in enumerate(dhts)]
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        futures = [a.step(wait=False, timeout=120, allow_retries=False) for a in averagers]
        groups = [len(f.result(timeout=180)) for f in futures]
        assert groups == [peers] * peers, groups
        times.append(time.perf_counter() - began)
    out["on" if check else "off"] = times
    for a in averagers:
        a.shutdown()
print(json.dumps(out))
for d in dhts:
    d.shutdown()
"""


def rows_per_peer(peers: int, size: int, part_values: int) -> int:
    """Claim rows one peer receives per round: from each other member, a row per part it was sent
    back (every part of the tensor) and, as a reducer, a row per part it reduced and sender."""
    parts_total = -(-size // part_values)
    per_reducer = -(-parts_total // peers)
    return (peers - 1) * (parts_total + per_reducer * peers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=4)
    ap.add_argument("--sizes", default="1e5,1e6,4e6", help="values per peer, comma-separated")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES

    from dedloc_core.engine import reducer_check as rc

    print(f"{args.peers} averagers on loopback, centered_clip, fp16, {args.rounds} rounds each way")
    print(f"{'values':>9} {'round off':>10} {'round on':>9} {'+ms':>7} {'+%':>6} {'claims KB':>10} {'sent KB':>13}")
    last = ""
    for size in (int(float(s)) for s in args.sizes.split(",")):
        began = time.monotonic()
        run = subprocess.run([sys.executable, "-c", PEERS, str(args.peers), str(size), str(args.rounds)],
                             cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if run.returncode:
            raise SystemExit(run.stderr[-3000:])
        times = json.loads(run.stdout.strip().splitlines()[-1])
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        part_values = DEFAULT_PART_SIZE_BYTES // 2  # fp16: two bytes a value
        claims = rows_per_peer(args.peers, size, part_values) * rc.ROW * 8 / 1024
        sent = size * 2 * (args.peers - 1) / args.peers / 1024
        print(f"{size:9d} {off * 1000:9.0f}ms {on * 1000:8.0f}ms {(on - off) * 1000:7.0f} "
              f"{100 * (on - off) / off:6.1f} {claims:10.1f} {sent:13.1f}   ({time.monotonic() - began:.0f} s)",
              flush=True)
        last = (f"verify_cost: peers {args.peers}, size {size}, round {(on - off) * 1000:+.0f} ms "
                f"({100 * (on - off) / off:+.0f} %), claims {claims:.0f} KB per peer per round "
                f"({100 * claims / sent:.0f} % of the all-reduce)")
    print(last)


if __name__ == "__main__":
    main()
