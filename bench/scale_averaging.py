"""Averaging without training: how rounds fare as the swarm grows (root for shaped links, Linux).

    PYTHONPATH=. .venv/bin/python bench/scale_averaging.py [--peers 8,16,32,64] [--rounds 5]
        [--size-mb 2] [--matchmaking 3] [--plain] [--loopback] [--quick]

Per N, a bootstrap DHT node (as the backbone: it serves the DHT and averages nothing) and N peers,
each its own process as a worker is: ``swarm.prepare_process()`` (our hivemind extensions, fork,
fd sharing), a DHT joined through the bootstrap node (``swarm.start_dht``; at most ``STARTING`` peers
start at once), and a ``DecentralizedAverager`` configured as
``swarm.build_optimizer`` configures the gradient averager: fp16 compression, ``request_timeout``
1 s, ``next_chunk_timeout`` ``swarm.chunk_timeout``, no target group size (hivemind.Optimizer's:
one group of whoever matched), the catalog's default matchmaking time and averaging timeout, a
search as long as a worker's gradient round makes in a swarm of N (``swarm.matchmaking_window``:
the group closes that long after the round begins; ``--plain``: hivemind's, the matchmaking time), and the
declared bandwidth (the peer's uplink, Mbit/s) that our LP (``engine/load_balancing.py``) splits
the vector by. The averaged tensor holds ``--size-mb`` MB of float32 values, different per peer
and round: peer i's is ``noise_r * s_i + s_i`` with ``s_i = (i + 1) / N`` and ``noise_r`` random
per round, so a peer checks its result against the mean over the group it was in (hivemind's
``gather``) from one generated tensor.

Links (the default; root): every peer is a public host in ``tests/netlab``'s Lab with a home-like
link: 10 to 100 Mbit/s down, a fifth of that up, 20 to 150 ms one-way delay (``shape``). The
bootstrap node's link is not shaped. ``--loopback``: no lab, every process on 127.0.0.1.

Rounds go in lockstep: the bench tells all peers to start round r at the same moment once every
peer has reported round r - 1. A warm-up round comes first and is shown, not counted (a freshly
started swarm's first dials can meet libp2p's dial backoff and leave a peer without a group). Peers
stay up until every round is reported: a reducer that leaves as soon as its own step returns fails
the zero-share senders it still owes their results. A round succeeds when every peer's step returned and its result is
the mean of its group's tensors (within fp16's error). Its groups *agree* when every peer's step returned and the
peers of each group hold the same average: a reducer that drops a late sender averages the others' parts and sends
every peer that average (hivemind's design), so such a round agrees without the exact mean of everyone ``gather``
lists. Per N it prints the round times (the slowest
peer's step, matchmaking included), the group sizes formed, the LP's solve time and split for
those groups (``load_balance_peers`` called here on each group's declared bandwidths, as every
member's averager calls it), the peers' memory (RSS and USS summed over their process trees),
the machine's CPU busy during the rounds (all cores; near 100 % the lab, not the design, sets the
round time), and
``scale_averaging: peers N, rounds R, success S %, round T s (p95 P s), group G`` as each N ends (after a line
with the share of rounds whose groups agree);
then the table. Each peer's log (hivemind's warnings) stays in the temporary folder ``scaleN-*``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

MATCHMAKING_TIME = 3.0  # the catalog's default (catalog/model.py, swarm.SwarmConfig)
AVERAGING_TIMEOUT = 30.0
# peers starting at once: 64 processes importing torch and hivemind together on two cores (load
# average 88) made p2pd miss its bootstrap node for a minute and quit
STARTING = 8

BOOTSTRAP = """
import sys, time, hivemind
from dedloc_core.engine import swarm
swarm.prepare_process()
dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{sys.argv[1]}/tcp/0"])
print(" ".join(str(a) for a in dht.get_visible_maddrs()), flush=True)
while True:
    time.sleep(60)
"""

PEER = """
import json, sys, time, traceback
from pathlib import Path
import torch, hivemind
from hivemind.compression import Float16Compression
from hivemind.utils import get_dht_time
from dedloc_core.engine import swarm
a = json.loads(sys.argv[1])
swarm.prepare_process()
import logging
logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
if a["debug"]:
    for name in ("hivemind.averaging", "hivemind.p2p", "dedloc_core"):
        logging.getLogger(name).setLevel(logging.DEBUG)
i, n, size, out, go = a["index"], a["peers"], a["size"], Path(a["out"]), Path(a["go"])
def say(**kw):
    with out.open("a") as f:
        f.write(json.dumps(kw) + "\\n")
cfg = swarm.SwarmConfig(run_id="scale", target_batch_size=1, batch_size_per_step=1,
                        matchmaking_time=a["matchmaking"], averaging_timeout=a["timeout"],
                        initial_peers=[a["bootstrap"]], host_maddrs=[f"/ip4/{a['ip']}/tcp/0"])
dht = swarm.start_dht(cfg)  # as a worker starts it: p2pd tries again if the bootstrap node is slow to answer
averager = hivemind.averaging.DecentralizedAverager(
    [torch.zeros(size)], dht=dht, prefix="scale_grad_averager", target_group_size=None,
    min_matchmaking_time=cfg.matchmaking_time, request_timeout=1.0, next_chunk_timeout=swarm.chunk_timeout(cfg),
    compression=Float16Compression(), bandwidth=a["bandwidth"], start=True)
say(ready=True)
s = (i + 1) / n
done = -1
while done < a["rounds"] - 1:
    text = go.read_text() if go.exists() else ""
    if not text or int(text.split()[0]) <= done:
        time.sleep(0.05)
        continue
    r, start = int(text.split()[0]), float(text.split()[1])
    noise = torch.randn(size, generator=torch.Generator().manual_seed(r))
    with averager.get_tensors() as tensors:
        tensors[0].copy_(noise * s + s)
    time.sleep(max(0.0, start - time.time()))
    began = time.perf_counter()
    try:
        lead = a["window"]  # as a worker's gradient round in a swarm of n (swarm.matchmaking_window)
        gathered = averager.step(gather=i, scheduled_time=get_dht_time() + lead,
                                 timeout=cfg.averaging_timeout + lead - cfg.matchmaking_time)
        took = time.perf_counter() - began
        members = sorted(gathered.values())
        m = sum((j + 1) / n for j in members) / len(members)
        with averager.get_tensors() as tensors:
            err = float((tensors[0] - (noise * m + m)).abs().max())
            # what the peer holds, in the units of s: a group's peers hold one value, whoever was left out
            held = float((tensors[0] / (noise + 1)).median())
        say(round=r, ok=err < 0.05, time=took, group=members, err=err, held=round(held, 4))
    except Exception as exc:
        say(round=r, ok=False, time=time.perf_counter() - began, group=None, err=None,
            error=f"{type(exc).__name__}: {exc}"[:300])
    done = r
while go.read_text().split()[0] != "end":  # a reducer that leaves at once fails its zero-share senders
    time.sleep(0.1)
averager.shutdown()
dht.shutdown()
"""


def shape(i: int):
    """Peer i's home-like link: down 10-100 Mbit/s, up a fifth of that, 20-150 ms one way."""
    from netlab.lab import Shape

    down = 10 + 90 * (i % 8) / 7
    delay = 20 + 130 * ((3 * i + 1) % 8) / 7
    return Shape(up_mbit=round(down / 5, 1), down_mbit=round(down, 1), delay_ms=round(delay))


def tree_memory(procs) -> tuple[float, float]:
    """RSS and USS (MiB) summed over the processes and all their descendants."""
    rss = uss = 0
    for proc in procs:
        try:
            top = psutil.Process(proc.pid)
            for p in [top, *top.children(recursive=True)]:
                info = p.memory_full_info()
                rss, uss = rss + info.rss, uss + info.uss
        except psutil.Error:
            pass
    return rss / 2**20, uss / 2**20


def lp_split(groups: list[tuple[int, ...]], bandwidths: list[float], size: int) -> tuple[float, float, float, int]:
    """Our LP on each distinct group: the slowest solve (ms), the smallest and largest share of
    the vector (of the groups with more than one peer), and the most members of one group that got no part."""
    from dedloc_core.engine.load_balancing import load_balance_peers

    solve, low, high, idle = 0.0, 1.0, 0.0, 0
    for group in set(groups):
        if len(group) < 2:
            continue
        began = time.perf_counter()
        parts = load_balance_peers(size, [bandwidths[j] for j in group])
        solve = max(solve, (time.perf_counter() - began) * 1000)
        low, high = min(low, min(parts) / size), max(high, max(parts) / size)
        idle = max(idle, sum(1 for p in parts if p == 0))
    return solve, low, high, idle


def run_n(n: int, args, lab_cls) -> dict:
    size = int(args.size_mb * 2**20 / 4)
    window = args.matchmaking
    if not args.plain:
        from dedloc_core.engine.swarm import matchmaking_window

        window = matchmaking_window(n, args.matchmaking, AVERAGING_TIMEOUT)
    print(f"  N={n}: rounds look for their group {window:.1f} s", flush=True)
    work = Path(tempfile.mkdtemp(prefix=f"scale{n}-"))
    go = work / "go"
    shapes = [shape(i) for i in range(n)]
    bandwidths = [s.up_mbit for s in shapes]
    procs: list = []
    lab = lab_cls() if lab_cls else None
    try:
        if lab:
            lab.__enter__()
            boot_host = lab.public("boot")
            boot = lab.popen(boot_host, [sys.executable, "-c", BOOTSTRAP, boot_host.ip], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
        else:
            boot = subprocess.Popen([sys.executable, "-c", BOOTSTRAP, "127.0.0.1"], cwd=ROOT,
                                    stdout=subprocess.PIPE, text=True)
        procs.append(boot)
        bootstrap = boot.stdout.readline().split()[0]
        began = time.monotonic()
        outs = []

        def lines(out: Path) -> list[dict]:
            return [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []

        def stop_if_dead(slow: bool = False) -> None:
            dead = [i for i, p in enumerate(procs[1:]) if p.poll() is not None]
            if dead or slow:
                tail = (work / f"peer{(dead or [0])[0]}.log").read_text()[-2000:]
                raise SystemExit(f"peers {dead or 'slow'} did not start ({work}):\n{tail}")

        for i in range(n):
            while i - sum(1 for o in outs if lines(o)) >= STARTING:  # at most STARTING peers starting at once
                stop_if_dead()
                time.sleep(0.2)
            out = work / f"peer{i}.jsonl"
            outs.append(out)
            peer_args = dict(index=i, peers=n, size=size, out=str(out), go=str(go), bootstrap=bootstrap,
                             bandwidth=bandwidths[i], matchmaking=args.matchmaking, timeout=AVERAGING_TIMEOUT,
                             rounds=args.rounds + 1, ip="127.0.0.1", debug=args.debug, window=window)
            log = (work / f"peer{i}.log").open("w")
            if lab:
                host = lab.public(f"p{i}", shapes[i])
                peer_args["ip"] = host.ip
                proc = lab.popen(host, [sys.executable, "-c", PEER, json.dumps(peer_args)], cwd=ROOT,
                                 stdout=log, stderr=subprocess.STDOUT)
            else:
                proc = subprocess.Popen([sys.executable, "-c", PEER, json.dumps(peer_args)], cwd=ROOT,
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(proc)

        deadline = time.monotonic() + 60 + 10 * n
        while sum(1 for o in outs if lines(o)) < n:
            stop_if_dead(time.monotonic() > deadline)
            time.sleep(0.5)
        started = time.monotonic() - began
        rss, uss = tree_memory(procs)
        results = []
        for r in range(args.rounds + 1):  # round 0 warms up: first dials, DHT records, libp2p dial backoff
            go.write_text(f"{r} {time.time() + 1.0}")
            psutil.cpu_percent()  # the machine's CPU from here to the round's end
            limit = time.monotonic() + AVERAGING_TIMEOUT + 60
            while True:
                got = [[x for x in lines(o) if x.get("round") == r] for o in outs]
                if all(got) or time.monotonic() > limit:
                    break
                time.sleep(0.2)
            rows = [g[0] if g else dict(ok=False, time=None, group=None, error="no report") for g in got]
            busy = psutil.cpu_percent()
            for x in rows:
                x["busy"] = busy
            if r:
                results.append(rows)
            ok = all(x["ok"] for x in rows)
            sizes = sorted({len(x["group"]) for x in rows if x["group"]})
            slow = max((x["time"] or 0) for x in rows)
            errors = {x.get("error") for x in rows if x.get("error")}
            failed = sum(1 for x in rows if not x["ok"])
            what = "ok" if ok else f"FAILED at {failed} peers"
            print(f"  N={n} {f'round {r}' if r else 'warm-up'}: {what}, {slow:.1f} s, CPU {busy:.0f} %, "
                  f"groups of {sizes}"
                  + (f", errors: {sorted(errors)[:2]}" if errors else ""), flush=True)
        go.write_text("end")
        time.sleep(2.0)
        return dict(n=n, results=results, started=started, rss=rss, uss=uss, size=size, bandwidths=bandwidths,
                    work=work)
    finally:
        if lab:
            lab.close()
        else:
            for p in procs:
                p.kill()
            for p in procs:
                p.wait()


def agree(rows: list[dict]) -> bool:
    """Every peer's step returned, and the peers of each group hold the same average: a round whose
    reducer left a late sender out (the others average without it, by design) agrees, though its
    peers miss the exact mean of everyone ``gather`` lists (``success``)."""
    if not all(x["group"] for x in rows):
        return False
    held: dict[tuple, set] = {}
    for x in rows:
        held.setdefault(tuple(x["group"]), set()).add(x["held"])
    return all(max(v) - min(v) < 1e-3 for v in held.values())


def summarize(run: dict) -> dict:
    results, n = run["results"], run["n"]
    success = [all(x["ok"] for x in rows) for rows in results]
    agreed = [agree(rows) for rows in results]
    times = sorted(max((x["time"] or 0) for x in rows) for rows in results)
    groups = [tuple(x["group"]) for rows in results for x in rows if x["group"]]
    sizes = [len(g) for g in groups] or [0]
    histogram = {k: sizes.count(k) for k in sorted(set(sizes))}
    solve, low, high, idle = lp_split([g for g in groups if len(g) > 1], run["bandwidths"], run["size"])
    p95 = times[min(len(times) - 1, int(0.95 * len(times)))]
    return dict(n=n, rounds=len(results), success=100 * sum(success) / len(success),
                agreed=100 * sum(agreed) / len(agreed), mean=statistics.mean(times),
                p95=p95, group=statistics.mean(sizes), histogram=histogram, solve=solve, low=low, high=high,
                idle=idle, started=run["started"], rss=run["rss"], uss=run["uss"],
                busy=statistics.mean(rows[0]["busy"] for rows in results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="8,16,32,64", help="swarm sizes, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--size-mb", type=float, default=2.0, help="float32 MB averaged per peer")
    ap.add_argument("--loopback", action="store_true", help="no network lab: all peers on 127.0.0.1")
    ap.add_argument("--matchmaking", type=float, default=MATCHMAKING_TIME, help="min matchmaking time, s")
    ap.add_argument("--plain", action="store_true",
                    help="hivemind's search (the matchmaking time), not swarm.matchmaking_window's")
    ap.add_argument("--debug", action="store_true", help="peers log hivemind's averaging at DEBUG")
    ap.add_argument("--quick", action="store_true", help="4 and 8 peers, 2 rounds, 0.5 MB")
    args = ap.parse_args()
    if args.quick:
        args.peers, args.rounds, args.size_mb = "4,8", 2, 0.5
    lab_cls = None
    if not args.loopback:
        from netlab import Lab
        from netlab.lab import lab_unavailable_reason

        reason = lab_unavailable_reason()
        if reason:
            raise SystemExit(f"no network lab ({reason}): run as root, or pass --loopback")
        lab_cls = Lab
    where = "loopback" if args.loopback else "shaped links (10-100 Mbit/s down, 1/5 up, 20-150 ms)"
    print(f"averaging only, {args.size_mb} MB float32 per peer (fp16 on the wire), {where}, "
          f"matchmaking {args.matchmaking} s, timeout {AVERAGING_TIMEOUT} s, {args.rounds} rounds", flush=True)
    rows = []
    for n in (int(x) for x in args.peers.split(",")):
        rows.append(summarize(run_n(n, args, lab_cls)))
        s = rows[-1]
        print(f"  N={n}: started in {s['started']:.0f} s, peers' memory RSS {s['rss']:.0f} MiB, "
              f"USS {s['uss']:.0f} MiB; groups {s['histogram']}", flush=True)
        print(f"  N={n}: rounds whose groups agree (a late sender left out, by design): {s['agreed']:.0f} %",
              flush=True)
        print(f"scale_averaging: peers {s['n']}, rounds {s['rounds']}, success {s['success']:.0f} %, "
              f"round {s['mean']:.1f} s (p95 {s['p95']:.1f} s), group {s['group']:.1f}", flush=True)
    print(f"{'peers':>5} {'rounds':>6} {'success':>8} {'round s':>8} {'p95 s':>6} {'group':>6} "
          f"{'LP ms':>6} {'share min':>9} {'share max':>9} {'no part':>7} {'USS MiB':>8} {'CPU %':>6}")
    for s in rows:
        print(f"{s['n']:5d} {s['rounds']:6d} {s['success']:7.0f}% {s['mean']:8.1f} {s['p95']:6.1f} "
              f"{s['group']:6.1f} {s['solve']:6.2f} {s['low']:9.3f} {s['high']:9.3f} {s['idle']:7d} "
              f"{s['uss']:8.0f} {s['busy']:6.0f}")


if __name__ == "__main__":
    main()
