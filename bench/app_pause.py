"""Pause latency through the app a user runs: from the pointer moving to the worker using under 5% of a core.

    .venv/bin/python bench/app_pause.py [--trials 20] [--fresh 3]

A real desktop (Xvfb, openbox, trayer), a real backbone on loopback serving a signed catalog, one
headless volunteer (a real worker) so that averaging rounds and optimizer steps happen every few
seconds, and `dedloc app --hidden` itself, already joined, "only when I am not using the computer"
with the shortest threshold the preferences allow (30 s). Each trial waits until the user counts as
away and the app's worker trains at full speed, moves the real pointer (xdotool) and times until the
worker process used under 5% of one core over 100 ms (psutil every 10 ms). The app is started
``--fresh`` times; after each start a trial comes while the worker starts ("start": importing torch
and hivemind, fetching data, building the model), the next as soon as its log says "Ready to train"
("first": the first pause after joining), the others once it trains ("settled"). A settled trial
is marked "round" when the worker's log shows an optimizer step or averaging within the second
before the input or during the pause.

Prints each trial, p50/p95 overall and per kind; the last line is ``pause p95 ms: X``. Target X <= 100.
The whole tree's CPU (the averager and DHT processes, p2pd too) is shown beside it: when it first went
quiet, when it went quiet for good (no 1 s window at 5% of a core after it, ``HELD_S`` watched; a
later one is named by process), and its mean CPU from 1 s after the input to ``HELD_S``.
Needs: xvfb openbox trayer xdotool x11-utils (apt). About 15 minutes with the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from pause_latency import QUIET, CpuMeter, percentile, sample_ahead  # noqa: E402

from tests.desktop import stop, xdotool, xvfb  # noqa: E402

AWAY_S = 30.0  # prefs.idle_minutes = 0.5, the least the preferences allow
HELD_S = 8.0  # how long after the input the tree is watched for a late wake-up
ROUND_WORDS = ("optimizer step", "Averag", "averag", "matchmaking", "group")


def experiment() -> dict:
    manifest = json.loads((ROOT / "resources" / "corpus" / "manifest.json").read_text())
    return {
        "id": "app-pause-bench", "title": "App pause benchmark", "description": "bench/app_pause.py",
        "organizer": "bench", "recipe": "tiny-lm",
        "recipe_params": {"d_model": 128, "n_layers": 2, "n_heads": 2, "seq_len": 64, "warmup_steps": 0},
        "run_id": f"app_pause_{os.getpid()}", "initial_peers": [],
        "target_batch_size": 64, "batch_size_per_step": 8, "matchmaking_time": 2.0, "averaging_timeout": 20.0,
        "hardware": {"ram_gb": 1, "cpu_cores": 1, "disk_gb": 1, "gpu_required": False},
        "data": {"base_url": None, "shards": [
            {"url": f"data/{s['name']}", "sha256": s["sha256"], "size": s["size"]} for s in manifest["shards"][:2]]},
        "needs_token": False, "status": "active", "expires_at": None,
    }


class TreeMeter(CpuMeter):
    """CpuMeter over a process and all its descendants (the worker's DHT, averagers, p2pd)."""

    def __init__(self, pid: int):
        self.parts: list[tuple[float, dict[str, float]]] = []  # each process's CPU seconds, by name
        super().__init__(pid)

    def _run(self) -> None:
        sample_ahead()
        while not self._stop.is_set():
            total, part = 0.0, {}
            try:
                for p in [self.proc, *self.proc.children(recursive=True)]:
                    try:
                        t = p.cpu_times()
                        total += t.user + t.system
                        part[self._name(p)] = t.user + t.system
                    except psutil.Error:
                        pass
            except psutil.Error:
                return
            now = time.monotonic()
            self.samples.append((now, total))
            self.parts.append((now, part))
            del self.samples[:-3000], self.parts[:-3000]
            time.sleep(0.02)

    def _name(self, p: psutil.Process) -> str:
        if p.pid == self.proc.pid:
            return "worker"
        return "p2pd" if p.name() == "p2pd" else f"helper {p.pid}"  # hivemind's forked DHT and averagers

    def busiest(self, t0: float, t1: float) -> str:
        """Which processes of the tree used the CPU between two moments, as "name 12%" by share of a core."""
        first = next((s for s in self.parts if s[0] >= t0), None)
        last = next((s for s in reversed(self.parts) if s[0] <= t1), None)
        if first is None or last is None or last[0] <= first[0]:
            return ""
        used = {name: (cpu - first[1].get(name, 0.0)) / (last[0] - first[0]) for name, cpu in last[1].items()}
        return ", ".join(f"{name} {share * 100:.0f}%" for name, share in sorted(used.items(), key=lambda x: -x[1])
                         if share >= 0.01)

    def quiet_for_good(self, t_input: float, until: float, window: float = 1.0) -> float:
        """Seconds from ``t_input`` to the end of the last ``window`` before ``until`` in which the
        tree used 5% of a core or more: from then on it stayed quiet (0 if it never was busy). One
        second is what a CPU meter shows (top, a desktop's system monitor refresh each second or
        slower); shorter windows count single scheduler ticks (10 ms) of idle threads."""
        samples = [s for s in self.samples if t_input <= s[0] <= until]
        last = t_input
        for i, (t0, c0) in enumerate(samples):
            end = next((s for s in samples[i:] if s[0] >= t0 + window), None)
            if end is None:
                break
            if (end[1] - c0) / (end[0] - t0) >= QUIET:
                last = end[0]
        return last - t_input


def worker_of(app: psutil.Process, timeout: float) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in app.children():
            try:
                if "dedloc_core.engine.worker" in " ".join(child.cmdline()):
                    return child
            except psutil.Error:
                pass
        time.sleep(0.1)
    raise SystemExit("the app started no worker")


def _stamped(log: Path):
    """The worker log's lines with their wall-clock time."""
    for line in log.read_text(errors="replace").splitlines():
        try:
            yield datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp(), line
        except ValueError:
            continue


def in_round(log: Path, since: float, until: float) -> bool:
    """Did the worker log an optimizer step or averaging between two wall-clock moments?"""
    return any(since <= stamp <= until and any(w in line for w in ROUND_WORDS) for stamp, line in _stamped(log))


def log_lines(log: Path, since: float, until: float, most: int = 2) -> list[str]:
    """The worker's last log lines between two wall-clock moments (its own words for a late wake-up)."""
    return [line[24:160] for stamp, line in _stamped(log) if since <= stamp <= until][-most:]


def wait_training(meter: CpuMeter, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        now = time.monotonic()
        if meter.rate(now - 0.5, now) > 0.3:
            return
        if now > deadline:
            raise SystemExit("the worker did not train at full speed")
        time.sleep(0.05)


def volunteer(ready: dict, root: Path):
    from dedloc_core.protocol import Limits, Start
    from dedloc_core.workerproc import WorkerProcess

    home = root / "volunteer"
    home.mkdir(parents=True)
    worker = WorkerProcess(env={**os.environ, "DEDLOC_HOME": str(home), "DEDLOC_WORKER_NICE": "0"},
                           stderr=open(home / "worker.log", "w"))
    worker.start()
    worker.send(Start(experiment=experiment(), initial_peers=ready["maddrs"], data_base_url=ready["http_url"],
                      identity_path=str(home / "identity.key"), seed=1, limits=Limits(cpu_threads=1)))
    if worker.wait_for(lambda e: e.type == "state" and e.state == "training", 180) is None:
        raise SystemExit(f"the helper volunteer did not start; see {home / 'worker.log'}")
    return worker


def wait_ready(log: Path, timeout: float) -> None:
    """Until the worker's log says it joined and is about to train ("Ready to train")."""
    deadline = time.monotonic() + timeout
    while not (log.exists() and "Ready to train" in log.read_text(errors="replace")):
        if time.monotonic() > deadline:
            raise SystemExit(f"the worker did not join in {timeout:.0f} s; see {log}")
        time.sleep(0.02)


# kind, in a round, worker quiet, tree quiet, tree quiet for good, the tree's mean CPU from 1 s on
Row = tuple[str, bool, float, float, float, float]


def run_app(display: str, env: dict, trials: int, log, during_start: bool) -> list[Row]:
    """Start the app and run ``trials`` trials, stop it. With ``during_start`` the first comes while
    the worker starts (imports, data, model), the next as soon as it has joined ("first"), else the
    first is that one; the others once it trains at full speed ("settled")."""
    app = subprocess.Popen([sys.executable, "-m", "dedloc_core.cli", "app", "--hidden"], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    worker_log = Path(env["DEDLOC_HOME"]) / "log" / "worker.log"
    kinds = (["start"] if during_start else []) + ["first"] + ["settled"] * trials
    try:
        worker = worker_of(psutil.Process(app.pid), 120)
        main, tree = CpuMeter(worker.pid), TreeMeter(worker.pid)
        try:
            for trial, kind in enumerate(kinds[:trials]):
                if trial:  # the user leaves: the app resumes once the threshold has passed
                    time.sleep(AWAY_S)
                if kind == "start":
                    wait_training(main, 120)  # importing torch and hivemind: a busy process
                elif kind == "first":
                    wait_ready(worker_log, 240)
                else:
                    wait_training(main, 60)
                    time.sleep(random.uniform(0.0, 3.0))  # anywhere in a micro-batch, a round or a step
                    wait_training(main, 60)  # busy right now: a starved worker would look paused already
                wall, t_input = time.time(), time.monotonic()
                # relative motion is device input, as a mouse makes (an absolute mousemove warps the
                # pointer, which X reports to no input-event listener)
                xdotool(display, "mousemove_relative", "--", str(random.randint(-40, 40)), str(random.randint(5, 40)))
                latency = main.quiet_after(t_input, timeout=30)
                whole = tree.quiet_after(t_input, timeout=30)
                if latency is None:
                    raise SystemExit("the worker kept using the CPU for 30 s after input")
                time.sleep(HELD_S)  # the pause lasts: does anything in the tree wake up again?
                for_good = tree.quiet_for_good(t_input, t_input + HELD_S)
                busy = in_round(worker_log, wall - 1.0, wall + latency)
                after = tree.rate(t_input + 1.0, t_input + HELD_S)
                rows.append((kind, busy, latency, whole if whole is not None else float("nan"), for_good, after))
                log(f"  {kind:8} {'round' if busy else 'train':6} {latency * 1000:6.0f} ms"
                    f"   (tree {rows[-1][3] * 1000:6.0f} ms, for good {for_good * 1000:6.0f} ms,"
                    f" {after * 100:4.1f}% from 1 s on)"
                    + (f" late: {tree.busiest(t_input + for_good - 1, t_input + for_good)}" if for_good > 1 else ""))
                if for_good > 1:
                    for line in log_lines(worker_log, wall + for_good - 2, wall + for_good):
                        log(f"      {line}")
        finally:
            main.close()
            tree.close()
    finally:
        stop(app, 60)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20, help="trials in all (at least --fresh)")
    p.add_argument("--fresh", type=int, default=3, help="app starts; each one's first trial is a first pause")
    p.add_argument("--no-during-start", dest="during_start", action="store_false",
                   help="no trial while the worker starts (by default each app start begins with one)")
    args = p.parse_args(argv)
    missing = [t for t in ("Xvfb", "xdpyinfo", "openbox", "trayer", "xdotool") if shutil.which(t) is None]
    if missing:
        print(f"needs {', '.join(missing)} (apt-get install xvfb x11-utils openbox trayer xdotool)")
        return 2
    from swarmpeer import start_backbone

    root = Path(tempfile.mkdtemp(prefix="app-pause-"))
    backbone, ready, key_b64 = start_backbone(experiment(), root, http=True, poll="1")
    helper = None
    rows: list[Row] = []
    try:
        helper = volunteer(ready, root)
        keys = root / "keys"
        keys.mkdir()
        (keys / "bench.pub").write_text(f"ed25519 {key_b64} bench\n")
        with xvfb(tray=True) as display:
            per_start = [args.trials // args.fresh + (i < args.trials % args.fresh) for i in range(args.fresh)]
            for start, n in enumerate(per_start):
                home = root / f"app{start}"
                (home / "config").mkdir(parents=True)
                (home / "config" / "preferences.json").write_text(json.dumps({
                    "version": 1, "consent": True, "experiment_id": experiment()["id"], "idle_only": True,
                    "idle_minutes": AWAY_S / 60, "other_cpu_limit": None}))
                env = {**os.environ, "DISPLAY": display, "QT_QPA_PLATFORM": "xcb", "DEDLOC_HOME": str(home),
                       "DEDLOC_CATALOG_URL": f"{ready['http_url']}catalog.json", "DEDLOC_TRUSTED_KEYS": str(keys),
                       "DEDLOC_INITIAL_PEERS": " ".join(ready["maddrs"]), "DEDLOC_LISTEN": "/ip4/127.0.0.1/tcp/0",
                       "DEDLOC_LOG_LEVEL": "INFO"}
                print(f"app start {start + 1} of {args.fresh}: {n} trials", flush=True)
                rows += run_app(display, env, n, lambda s: print(s, flush=True), args.during_start)
    finally:
        if helper is not None:
            helper.stop(timeout=20)
        backbone.stop(60)
    latencies = [r[2] for r in rows]
    for name, pick in (("while starting", lambda r: r[0] == "start"),
                       ("first after joining", lambda r: r[0] == "first"),
                       ("in a round or step", lambda r: r[0] == "settled" and r[1]),
                       ("while training", lambda r: r[0] == "settled" and not r[1])):
        some = [r[2] for r in rows if pick(r)]
        if some:
            print(f"{name:20} n={len(some):2}  p50 {percentile(some, 0.5) * 1000:5.0f} ms"
                  f"  max {max(some) * 1000:5.0f} ms")
    trees = [r[3] for r in rows if r[3] == r[3]]
    if trees:
        print(f"whole tree quiet      p50 {percentile(trees, 0.5) * 1000:5.0f} ms"
              f"  p95 {percentile(trees, 0.95) * 1000:5.0f} ms")
    settled = [r[4] for r in rows]
    if settled:
        print(f"tree quiet for good   p50 {percentile(settled, 0.5) * 1000:5.0f} ms"
              f"  p95 {percentile(settled, 0.95) * 1000:5.0f} ms  (no 1 s window at 5% of a core after it,"
              f" up to {HELD_S:.0f} s)")
    after = [r[5] for r in rows if r[5] == r[5]]
    if after:
        print(f"tree CPU from 1 s on  p50 {percentile(after, 0.5) * 100:5.1f} %   p95 "
              f"{percentile(after, 0.95) * 100:5.1f} %  (of a core, mean from 1 s to {HELD_S:.0f} s after the input)")
    print(f"pause p50 ms: {percentile(latencies, 0.5) * 1000:.0f}")
    print(f"pause p95 ms: {percentile(latencies, 0.95) * 1000:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
