"""A churning swarm in the network lab: N volunteers come and go while the swarm trains (root, Linux).

    PYTHONPATH=. .venv/bin/python bench/scale.py [--volunteers 16] [--minutes 8] [--session 180]
        [--cpu 0.07] [--seed 1] [--modes ours,defaults] [--keep DIR]

Set-up, per mode (a fresh lab each time, the same schedule and seed):
- a backbone (``dedloc backbone``, public, 0.2 cores) and ``--volunteers`` slots' worth of volunteers
  on home-like links (``scale_averaging.shape``: 10-100 Mbit/s down, a fifth of that up, 20-150 ms
  one way); every third one behind its own NAT router (``Lab.home``), reaching the others through
  the backbone's relay;
- each volunteer holds ``--cpu`` of a core (a cgroup quota) once it trains. At a tenth of a core a
  worker's imports alone take over half a minute, so a starting worker runs in a shared "starting"
  group (``START_CPU`` cores) and moves into its own group, every process of its tree, when it says
  "training". Its join time therefore holds less of the start than at its quota. The first
  ``--volunteers`` arrive ``STAGGER`` s apart. The quotas and the starting group add up to under two
  cores, but a burst of starts can still hold a volunteer below its quota for a moment;
- churn as in sahajBERT's sessions, compressed: session lengths exponential with mean ``--session``
  seconds (at least 30 s), gaps between a slot's sessions exponential with mean ``GAP`` s; enough
  slots that ``--volunteers`` are present on average. A session ends by SIGKILL (a laptop lid,
  30 %), a clean leave (the worker's stop, 40 %) or the user's pause (30 %; the next session
  resumes the same worker). A slot's sessions keep its identity and home;
- ``tiny-lm`` (d64, 2 layers, sequences of 32; micro-batches of 32) in sync mode, paced as
  ``swarm_netlab`` paces it, for ``--minutes``. "ours" and "hivemind defaults" as in ``swarm_netlab.MODES``.

Figures, per mode:
- utilization: the samples counted (computed less what state loads dropped) per second, over the
  solo rate at the quota (the bare loop, ``netlab/solo.py``, measured before and after the mode)
  times the volunteers present (training, in their quota, not paused); per minute and over the run;
- global steps (the highest step a live volunteer reports), the longest gap between two steps,
  the median step, and failed rounds (``Stats.rounds_failed`` over all rounds entered);
- samples: computed (the workers' last ``stats`` of each session), of which dropped by state loads,
  recorded (each slot's own real SQLite ``StatsRecorder``, as the app records), and credited by the
  swarm (the backbone's leaderboard in ``/swarm.json``; it lags by a metrics period);
- newcomers' join time (sessions started after the first step): to the swarm's step (state
  loaded) and to the first round joined;
- the backbone: cores (CPU seconds of its process tree over wall time), PSS, ``/swarm.json``
  latency from a viewer in the lab polling every 2 s.
Last line: ``scale: peers N, churn C per min, utilization U, defaults D, longest stall S s, failed
rounds F %, backbone cores B`` (ours; D: the defaults' utilization).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests"), str(ROOT)]

from conftest import tiny_experiment  # noqa: E402
from netlab import Lab  # noqa: E402
from netlab.peers import Backbone, Peer, solo_rates  # noqa: E402
from scale_averaging import shape  # noqa: E402
from swarm_netlab import MODES  # noqa: E402

from dedloc_core.engine import pacing  # noqa: E402
from dedloc_core.protocol import Pause, Resume  # noqa: E402
from dedloc_core.stats.db import StatsStore  # noqa: E402
from dedloc_core.stats.recorder import StatsRecorder  # noqa: E402

GAP = 30.0  # mean seconds between a slot's sessions
START_CPU = 0.6  # cores shared by starting workers
STAGGER = 3.0  # seconds between the first sessions' starts
BACKBONE_CPU = 0.2
ENDS = (("kill", 0.3), ("leave", 0.4), ("pause", 0.3))
RECIPE = {"d_model": 64, "n_layers": 2, "n_heads": 2, "seq_len": 32, "lr": 0.003, "warmup_steps": 0}
MICRO_BATCH = 32

VIEWER = """
import json, sys, time, urllib.request
url = sys.argv[1]
while True:
    began = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            doc = json.loads(r.read())
        board = {c["peer_id"]: c["samples"] for c in doc.get("leaderboard", [])}
        print(json.dumps({"t": time.time(), "ms": 1000 * (time.perf_counter() - began),
                          "step": doc.get("global_step", 0), "board": board}), flush=True)
    except Exception as exc:
        print(json.dumps({"t": time.time(), "error": str(exc)[:200]}), flush=True)
    time.sleep(2.0)
"""


@dataclass
class Event:
    at: float  # seconds from the start of the run
    slot: int
    kind: str  # start, kill, leave, pause


def schedule(n: int, seconds: float, session: float, seed: int) -> tuple[int, list[Event]]:
    """Slots and their sessions: about ``n`` present on average, each session ``session`` s on
    average (at least 30), ``GAP`` s between a slot's sessions. The first ``n`` slots arrive
    ``STAGGER`` s apart; the others within their first gap."""
    rng = random.Random(seed)
    slots = max(n, round(n * (session + GAP) / session))
    events: list[Event] = []
    for slot in range(slots):
        t = STAGGER * slot if slot < n else rng.expovariate(1 / GAP)
        while t < seconds:
            events.append(Event(t, slot, "start"))
            t += max(30.0, rng.expovariate(1 / session))
            if t >= seconds:
                break
            kind = rng.choices([k for k, _ in ENDS], [w for _, w in ENDS])[0]
            events.append(Event(t, slot, kind))
            t += rng.expovariate(1 / GAP)
    return slots, sorted(events, key=lambda e: (e.at, e.slot))


@dataclass
class Session:
    began: float
    peer: Peer
    resumed: bool = False
    ready: float | None = None  # moved into its quota (said "training")
    caught_up: float | None = None  # reached the swarm's step
    first_round: float | None = None
    ended: float | None = None
    how: str = ""
    rounds0: int = 0  # rounds of the same worker before a pause (a resumed session)
    fed: int = 0  # stats events given to the slot's recorder
    stopping: threading.Thread | None = None  # a clean leave runs beside the bench's loop
    closed: bool = False  # its worker's events are all recorded


@dataclass
class Slot:
    index: int
    host: object
    group: Path
    home: Path
    recorder: StatsRecorder
    sessions: list[Session] = field(default_factory=list)

    @property
    def live(self) -> Session | None:
        return self.sessions[-1] if self.sessions and self.sessions[-1].ended is None else None


def tree(pid: int) -> list[psutil.Process]:
    try:
        top = psutil.Process(pid)
        return [top, *top.children(recursive=True)]
    except psutil.Error:
        return []


def move(pid: int, group: Path) -> None:
    for proc in tree(pid):
        try:
            (group / "cgroup.procs").write_text(str(proc.pid))
        except OSError:
            pass  # gone meanwhile


def cpu_seconds(pid: int) -> float:
    total = 0.0
    for proc in tree(pid):
        try:
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total


def pss_mb(pid: int) -> float:
    total = 0
    for proc in tree(pid):
        try:
            total += proc.memory_full_info().pss
        except psutil.Error:
            pass
    return total / 2**20


def experiment(name: str, target_batch: int, matchmaking: float, opts: dict) -> dict:
    return tiny_experiment(id=f"scale-{name[:4]}", run_id=f"scale_{name[:4]}", batch_size_per_step=MICRO_BATCH,
                           target_batch_size=target_batch, matchmaking_time=matchmaking, averaging_timeout=30.0,
                           overlap=opts["overlap"], average_state_every=opts.get("average_state_every", 1),
                           recipe_params=RECIPE, volunteer_dht="client" if opts["overlap"] else "server")


def param_count() -> int:
    from dedloc_core.engine.recipes import load_recipe

    return sum(p.numel() for p in load_recipe("tiny-lm", RECIPE).build_model().parameters())


def run_mode(name: str, opts: dict, args, pace: pacing.Pace, slots_n: int, events: list[Event],
             folder: Path) -> dict:
    exp = experiment(name, pace.target_batch_size, pace.matchmaking_time, opts)
    with Lab() as lab:
        bb_host = lab.public("bb", cpu=BACKBONE_CPU)
        backbone = Backbone(lab, bb_host, exp, folder)
        ready = backbone.wait_ready()
        viewer_host = lab.public("view")
        viewer = lab.popen(viewer_host, [sys.executable, "-c", VIEWER, ready["http_url"] + "swarm.json"],
                           stdout=subprocess.PIPE, text=True)
        starting = lab.cpu_group(lab.public("start"), START_CPU)
        slots: list[Slot] = []
        for i in range(slots_n):
            host = lab.home(f"v{i}", shape(i)) if i % 3 == 2 else lab.public(f"v{i}", shape(i))
            group = lab.cpu_group(host, args.cpu)
            host.cgroup = starting  # workers start in the shared group (lab.launcher reads it)
            home = folder / f"v{i}"
            home.mkdir()
            slots.append(Slot(i, host, group, home, StatsRecorder(home / "stats.db", exp["id"])))
        fields = {"grad_compression": opts["grad_compression"]}

        def begin(slot: Slot, now: float) -> None:
            last = slot.sessions[-1] if slot.sessions else None
            if last is not None and last.how != "pause":
                close(slot, last)
            if last is not None and last.how == "pause":  # the user's resume: the same worker
                last.peer.worker.send(Resume())
                slot.sessions.append(Session(now, last.peer, resumed=True, ready=now, rounds0=last.peer.rounds))
                return
            log = slot.home / "worker.log"
            if log.exists():
                log.rename(slot.home / f"worker-{len(slot.sessions)}.log")
            peer = Peer(lab, slot.host, slot.home)
            extra = dict(fields, bandwidth=float(shape(slot.index).up_mbit)) if opts.get("bandwidth") else fields
            peer.start(exp, ready, seed=slot.index + 1, display_name=f"v{slot.index}", **extra)
            slot.recorder.begin(exp["id"])
            slot.sessions.append(Session(now, peer))

        def end(slot: Slot, kind: str, now: float) -> None:
            s = slot.live
            if s is None:
                return
            feed(slot, s)
            s.ended, s.how = now, kind
            if kind == "kill":
                s.peer.worker.kill()
                close(slot, s)
            elif kind == "leave":  # the worker's stop takes seconds: the churn goes on meanwhile
                s.stopping = threading.Thread(target=s.peer.stop, daemon=True)
                s.stopping.start()
            else:
                s.peer.worker.send(Pause(reason="user"))

        def feed(slot: Slot, s: Session) -> None:
            """The session's new stats events to the slot's recorder, in order (as the app records)."""
            s.peer.drain()
            if s.resumed or s.closed:
                return
            for event in s.peer.all_stats[s.fed:]:
                slot.recorder.on_event(event)
            s.fed = len(s.peer.all_stats)

        def close(slot: Slot, s: Session) -> None:
            """The worker is gone: the rest of its events, then the end of its stream."""
            if s.closed or s.resumed:
                return
            if s.stopping is not None:
                s.stopping.join()
            feed(slot, s)
            slot.recorder.on_event(None)
            s.closed = True

        clock0 = time.monotonic()
        pending = list(events)
        samples_t: list[tuple[float, int, int]] = []  # (t, counted samples so far, volunteers present)
        steps: list[tuple[float, int]] = []  # (t, swarm step) at each new step
        bb_cpu0, bb_pss = cpu_seconds(backbone.pid), 0.0
        viewer_lines: list[dict] = []
        os.set_blocking(viewer.stdout.fileno(), False)
        next_pss = 0.0
        while True:
            now = time.monotonic() - clock0
            if now >= args.minutes * 60:
                break
            while pending and pending[0].at <= now:
                e = pending.pop(0)
                slot = slots[e.slot]
                begin(slot, now) if e.kind == "start" else end(slot, e.kind, now)
                peer_id = next((x.peer_id for x in reversed(slot.sessions[-1].peer.states) if x.peer_id), None)
                with (folder / "events.jsonl").open("a") as log:  # for reading the workers' logs against
                    log.write(json.dumps({"time": time.time(), "t": round(now, 1), "slot": e.slot, "kind": e.kind,
                                          "peer_id": peer_id}) + "\n")
            swarm_step = steps[-1][1] if steps else 0
            present, counted = 0, 0
            for slot in slots:
                for s in slot.sessions:
                    feed(slot, s)
                    st = s.peer.stats
                    if st is not None and not s.resumed:
                        counted += st.samples - st.samples_dropped
                s = slot.live
                if s is None:
                    continue
                p = s.peer
                if s.ready is None and any(x.state == "training" for x in p.states):
                    move(p.worker.pid, slot.group)
                    s.ready = now
                if s.ready is not None:
                    present += 1
                if p.progress and s.caught_up is None and swarm_step and p.step >= swarm_step:
                    s.caught_up = now
                if s.first_round is None and p.rounds > s.rounds0:
                    s.first_round = now
            live_steps = [sl.live.peer.step for sl in slots if sl.live and sl.live.peer.progress]
            if live_steps and max(live_steps) > swarm_step:
                steps.append((now, max(live_steps)))
            samples_t.append((now, counted, present))
            line = viewer.stdout.readline()
            while line:
                viewer_lines.append(json.loads(line))
                line = viewer.stdout.readline()
            if now >= next_pss:
                bb_pss, next_pss = max(bb_pss, pss_mb(backbone.pid)), now + 15
            time.sleep(0.5)
        wall = time.monotonic() - clock0
        bb_cores = (cpu_seconds(backbone.pid) - bb_cpu0) / wall
        for slot in slots:
            for s in slot.sessions:
                if s.ended is None or s.how == "pause":
                    feed(slot, s)
                else:
                    close(slot, s)
        board = next((v["board"] for v in reversed(viewer_lines) if "board" in v), {})
        accounts = []
        for slot in slots:
            finals = [s.peer.stats for s in slot.sessions if not s.resumed and s.peer.stats]
            computed = sum(st.samples for st in finals)
            dropped = sum(st.samples_dropped for st in finals)
            slot.recorder.flush()
            recorded = StatsStore(slot.home / "stats.db").totals().samples
            ids = {x.peer_id for s in slot.sessions for x in s.peer.states if x.peer_id}
            credited = sum(board.get(i, 0) for i in ids)
            accounts.append((computed, dropped, recorded, credited))
        rounds = sum(s.peer.stats.rounds for sl in slots for s in sl.sessions if not s.resumed and s.peer.stats)
        failed = sum(s.peer.stats.rounds_failed for sl in slots for s in sl.sessions
                     if not s.resumed and s.peer.stats)
        joins = [(s.caught_up - s.began if s.caught_up else None, s.first_round - s.began if s.first_round else None)
                 for sl in slots for s in sl.sessions if steps and s.began > steps[0][0]]
        for slot in slots:
            slot.recorder.close()
        viewer.kill()
    return dict(samples_t=samples_t, steps=steps, rounds=rounds, failed=failed, joins=joins, accounts=accounts,
                bb_cores=bb_cores, bb_pss=bb_pss, http_ms=[v["ms"] for v in viewer_lines if "ms" in v],
                http_errors=sum(1 for v in viewer_lines if "error" in v), wall=wall)


def utilization(r: dict, solo: float, since: float, until: float) -> float:
    rows = [x for x in r["samples_t"] if since <= x[0] <= until]
    if len(rows) < 2:
        return float("nan")
    present = statistics.mean(x[2] for x in rows)
    return (rows[-1][1] - rows[0][1]) / (rows[-1][0] - rows[0][0]) / max(solo * present, 1e-9)


def percentile(values: list[float], q: float) -> float:
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--volunteers", type=int, default=16, help="present on average")
    ap.add_argument("--minutes", type=float, default=8.0, help="training time per mode")
    ap.add_argument("--session", type=float, default=180.0, help="mean session length, seconds")
    ap.add_argument("--cpu", type=float, default=0.07, help="each volunteer's CPU quota, cores")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--modes", default="ours,defaults")
    ap.add_argument("--keep", default="", help="copy the volunteers' logs here")
    args = ap.parse_args(argv)
    slots_n, events = schedule(args.volunteers, args.minutes * 60, args.session, args.seed)
    ends = sum(1 for e in events if e.kind != "start")
    churn = (ends + sum(1 for e in events if e.kind == "start" and e.at > 0)) / args.minutes
    print(f"{args.volunteers} volunteers on average ({slots_n} slots), sessions {args.session:.0f} s on average, "
          f"{ends} ends and {len(events) - ends} starts in {args.minutes:g} min; quota {args.cpu} cores", flush=True)

    def solo() -> float:
        with Lab() as lab:
            return solo_rates(lab, [lab.public("s", cpu=args.cpu)], experiment("solo", 256, 1.0, MODES["ours"]), 8.0)[0]

    before = solo()
    rate = before * args.volunteers
    round_est = pacing.round_seconds(param_count(), min(shape(i).up_mbit for i in range(slots_n)), 0.3)
    pace = pacing.pace(rate, round_est, headroom=4.0, multiple=64)
    print(f"solo {before:.1f} samples/s per volunteer; target batch {pace.target_batch_size} "
          f"({pace.step_seconds:.1f} s a step at {args.volunteers}), matchmaking {pace.matchmaking_time} s", flush=True)
    results = {}
    for key in args.modes.split(","):
        name = "ours" if key == "ours" else "hivemind defaults"
        with tempfile.TemporaryDirectory(prefix="scale-") as folder:
            began = time.monotonic()
            results[key] = run_mode(name, MODES[name], args, pace, slots_n, events, Path(folder))
            if args.keep:
                shutil.copytree(folder, Path(args.keep) / key, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("*.pt", "*.bin", "shards", "cache", "*.db*"))
        after = solo()
        results[key]["solo"] = (before + after) / 2
        print(f"# {name}: {time.monotonic() - began:.0f} s; solo {before:.1f} -> {after:.1f}", file=sys.stderr,
              flush=True)
        before = after
    return report(results, args, churn)


def report(results: dict, args, churn: float) -> int:
    rows = []
    for key, r in results.items():
        steps, solo = r["steps"], r["solo"]
        first = steps[0][0] if steps else r["wall"]
        gaps = [b[0] - a[0] for a, b in zip(steps, steps[1:], strict=False)]
        computed, dropped, recorded, credited = (sum(a[k] for a in r["accounts"]) for k in range(4))
        r.update(util=utilization(r, solo, first, r["wall"]), gaps=gaps, first=first,
                 failed_pct=100 * r["failed"] / max(r["rounds"] + r["failed"], 1),
                 computed=computed, dropped=dropped, recorded=recorded, credited=credited)
        rows.append(key)
    labels = [
        ("utilization (after the first step)", lambda r: f"{r['util']:.2f}"),
        ("first global step at s", lambda r: f"{r['first']:.0f}"),
        ("global steps", lambda r: str(r["steps"][-1][1] if r["steps"] else 0)),
        ("median step s", lambda r: f"{statistics.median(r['gaps']):.1f}" if r["gaps"] else "-"),
        ("longest gap s", lambda r: f"{max(r['gaps']):.1f}" if r["gaps"] else "-"),
        ("rounds ok / failed", lambda r: f"{r['rounds']} / {r['failed']}"),
        ("failed rounds %", lambda r: f"{r['failed_pct']:.1f}"),
        ("samples computed", lambda r: str(r["computed"])),
        ("  dropped by state loads", lambda r: str(r["dropped"])),
        ("  recorded (SQLite)", lambda r: str(r["recorded"])),
        ("  credited (leaderboard)", lambda r: str(r["credited"])),
        ("join to swarm step p50/p95 s", lambda r: f"{percentile([j[0] for j in r['joins']], .5):.0f} / "
                                                  f"{percentile([j[0] for j in r['joins']], .95):.0f}"),
        ("join to first round p50/p95 s", lambda r: f"{percentile([j[1] for j in r['joins']], .5):.0f} / "
                                                   f"{percentile([j[1] for j in r['joins']], .95):.0f}"),
        ("sessions never caught up", lambda r: str(sum(1 for j in r["joins"] if j[0] is None))),
        ("backbone cores", lambda r: f"{r['bb_cores']:.3f}"),
        ("backbone PSS MB", lambda r: f"{r['bb_pss']:.0f}"),
        ("/swarm.json p50/p95 ms", lambda r: f"{percentile(r['http_ms'], .5):.0f} / {percentile(r['http_ms'], .95):.0f}"
                                             + (f" ({r['http_errors']} errors)" if r["http_errors"] else "")),
    ]
    print(f"{'':34}" + "".join(f"{k:>20}" for k in rows))
    for label, cell in labels:
        print(f"{label:34}" + "".join(f"{cell(results[k]):>20}" for k in rows))
    for key, r in results.items():
        minutes = [utilization(r, r["solo"], t, t + 60) for t in range(int(r["first"]), int(r["wall"]) - 30, 60)]
        print(f"{key} utilization per minute: " + " ".join(f"{u:.2f}" for u in minutes))
    ours, theirs = results.get("ours"), results.get("defaults")
    if ours:
        stall = max(ours["gaps"]) if ours["gaps"] else float("nan")
        print(f"scale: peers {args.volunteers}, churn {churn:.1f} per min, utilization {ours['util']:.2f}, "
              f"defaults {theirs['util'] if theirs else float('nan'):.2f}, longest stall {stall:.1f} s, "
              f"failed rounds {ours['failed_pct']:.1f} %, backbone cores {ours['bb_cores']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
