"""Overhead of the volunteer worker (hivemind) against a bare torch loop, measured in one run.

    .venv/bin/python bench/overhead.py [--seconds 60] [--warmup 20] [--model d256x4] [--batch 8]
    .venv/bin/python bench/overhead.py --recipe causal-lm [--model '{"family": "gpt2", ...}']

``--recipe causal-lm`` or ``masked-lm`` measures a declared transformers model (llama by default,
albert for masked-lm) on token shards that ``dedloc data prepare`` makes of the shipped corpus first;
``--model`` JSON is merged into the prepared entry's recipe_params (``config`` key by key).

Two phases on the same machine, one after the other, each with two processes of one torch thread
(a two-peer swarm on a 2-core machine keeps both cores busy, so the bare side does too):

1. bare: two copies of a plain torch loop (forward, backward, optimizer step every
   target_batch/batch micro-batches, like hivemind's local accumulation), each in its own
   subprocess, run side by side. Each measures its samples/s over the steady window (between two
   step boundaries), its PSS at the end of the window and the CPU of its non-main threads.
2. swarm: two real workers (``dedloc_core.engine.worker`` through ``WorkerProcess``), the first the other's
   initial peer, training the same model on the same micro-batch with a target batch so large
   that the window is pure gradient accumulation. The corpus is served over HTTP on loopback.
   Samples/s comes from the workers' cumulative ``stats`` events (sent right after a micro-batch,
   so their arrival times are step boundaries); memory is the PSS of one worker's whole process
   tree (python, its forked averager processes, p2pd: whatever the worker runs); background CPU is
   the CPU time, over the window, of every descendant plus the worker process's non-main threads,
   divided by the window's wall time.

The last line is ``overhead ratio: X`` with X = swarm samples/s / bare samples/s (means of the two
processes of each phase). Targets (bench/README.md): X >= 0.95, memory <= 1.5x, background <= 0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGET_BATCH = 10_000_000  # never reached in the window: the swarm only accumulates


def recipe_params(args: argparse.Namespace) -> dict:
    if args.recipe == "tiny-lm":
        return parse_model(args.model or "d256x4")
    params = prepared(args)["recipe_params"]
    extra = json.loads(args.model) if args.model else {}
    return {**params, **extra, "config": {**params["config"], **extra.get("config", {})}}


def prepared(args: argparse.Namespace) -> dict:
    return json.loads((args.data / "catalog-entry.json").read_text())


def prepare_data(args: argparse.Namespace, out: Path) -> None:
    """A declared recipe's shards, tokenizer and entry: ``dedloc data prepare`` on the shipped corpus."""
    extra = json.loads(args.model) if args.model else {}
    kind = "masked" if args.recipe == "masked-lm" else "causal"
    family = extra.get("family", "albert" if kind == "masked" else "llama")
    cmd = [sys.executable, "-m", "dedloc_core.cli", "data", "prepare", str(ROOT / "resources" / "corpus"),
           "--out", str(out), "--kind", kind, "--family", family, "--seq-len", str(extra.get("seq_len", 128))]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    args.data = out


def parse_model(spec: str) -> dict:
    """``d256x4`` (d_model x layers, seq 128, 4 heads), ``d256x4s64`` (seq 64) or a JSON dict."""
    spec = spec.strip()
    if spec.startswith("{"):
        return json.loads(spec)
    m = re.fullmatch(r"d(\d+)x(\d+)(?:s(\d+))?(?:h(\d+))?", spec)
    if not m:
        raise SystemExit(f"--model: expected e.g. d256x4, d128x2s64 or a JSON dict, got {spec!r}")
    d, layers, seq, heads = m.groups()
    return {
        "d_model": int(d),
        "n_layers": int(layers),
        "seq_len": int(seq or 128),
        "n_heads": int(heads or 4),
        "dropout": 0.0,
        "warmup_steps": 0,
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="length of each measured window (default 60)")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds of training before each window (default 20)")
    p.add_argument("--recipe", choices=("tiny-lm", "causal-lm", "masked-lm"), default="tiny-lm",
                   help="tiny-lm (default) or a declared transformers model")
    p.add_argument("--model", default=None,
                   help="tiny-lm size: d256x4 (default, 3.3M params), or JSON params (merged for a declared recipe)")
    p.add_argument("--data", type=Path, default=None, help=argparse.SUPPRESS)  # a declared recipe's prepared shards
    p.add_argument("--batch", type=int, default=8, help="micro-batch size (default 8)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--peers", type=int, default=2, help="processes per phase (default 2)")
    p.add_argument(
        "--phase",
        choices=("both", "bare", "swarm"),
        default="both",
        help="run only one phase (no ratios then); default both",
    )
    p.add_argument("--keep", type=Path, default=None, help="keep the workers' logs in this directory")
    p.add_argument("--bare-stand-in", action="store_true",
                   help="the bare loop skips torch._dynamo's import too (engine.no_dynamo, as the worker does)")
    p.add_argument("--bare-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- helpers --------------------------------------------------------------------------------------


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def pss_bytes(procs: list[psutil.Process]) -> tuple[int, int, list[tuple[int, str, int, int]]]:
    """(sum of PSS, sum of RSS, [(pid, name, PSS, USS)]) over ``procs``."""
    pss = rss = 0
    each = []
    for proc in procs:
        try:
            info = proc.memory_full_info()
            name = proc.name()
        except psutil.Error:
            continue
        pss += info.pss
        rss += info.rss
        each.append((proc.pid, name, info.pss, info.uss))
    return pss, rss, each


def background_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of ``pid``'s non-main threads (key -pid... per thread id) and of each descendant."""
    out: dict[int, float] = {}
    root = psutil.Process(pid)
    try:
        for th in root.threads():
            if th.id != pid:
                out[-th.id] = th.user_time + th.system_time  # negative keys: threads of the root
    except psutil.Error:
        pass
    for child in root.children(recursive=True):
        try:
            t = child.cpu_times()
            out[child.pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def main_thread_cpu(pid: int) -> float:
    for th in psutil.Process(pid).threads():
        if th.id == pid:
            return th.user_time + th.system_time
    return 0.0


class LoadMeter:
    """CPU cores used by everything on the machine that is not this bench or its descendants."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.ours0 = time.monotonic(), self._busy(), self._ours()

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)

    @staticmethod
    def _ours() -> dict[int, float]:
        out = {}
        me = psutil.Process()
        for proc in [me, *me.children(recursive=True)]:
            try:
                t = proc.cpu_times()
                out[proc.pid] = t.user + t.system
            except psutil.Error:
                pass
        return out

    def cores(self) -> float:
        wall = time.monotonic() - self.t0
        ours = cpu_delta(self.ours0, self._ours())
        return max(0.0, (self._busy() - self.busy0 - ours) / wall)


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    return sum(v - before.get(k, 0.0) for k, v in after.items())


# ---- phase 1: the bare loop ------------------------------------------------------------------------


def bare_child(args: argparse.Namespace) -> int:
    """One bare torch loop: the worker's loop without hivemind. Prints one JSON line."""
    import torch

    torch.set_num_threads(args.threads)
    from dedloc_core.engine.recipes import load_recipe

    if args.bare_stand_in:
        from dedloc_core.engine import no_dynamo

        no_dynamo.install()
    recipe = load_recipe(args.recipe, recipe_params(args), args.data / "tokenizer.json" if args.data else None)
    model = recipe.build_model(seed=0)
    opt = recipe.build_optimizer(model.parameters())
    batches = recipe.batches(sorted(args.data.glob("shard-*.npy")) if args.data else [], args.batch, seed=args.seed)
    accumulate = max(1, TARGET_BATCH // args.batch)
    me = psutil.Process()
    began = time.monotonic()
    window_start = began + args.warmup
    window_end = window_start + args.seconds
    samples = steps = 0
    t0 = s0 = None
    cpu0: dict[int, float] = {}
    loss_ema = None
    while True:
        batch = next(batches)
        loss = recipe.loss(model, batch)
        loss.backward()
        steps += 1
        if steps % accumulate == 0:
            opt.step()
            opt.zero_grad()
        samples += args.batch
        value = float(loss.detach())
        loss_ema = value if loss_ema is None else 0.9 * loss_ema + 0.1 * value
        now = time.monotonic()
        if t0 is None and now >= window_start:
            t0, s0, cpu0 = now, samples, background_cpu(me.pid)
            main0 = main_thread_cpu(me.pid)
        if t0 is not None and now >= window_end:
            break
    wall = now - t0
    pss, rss, each = pss_bytes([me])
    print(
        json.dumps(
            {
                "sps": (samples - s0) / wall,
                "pss": pss,
                "uss": each[0][3],
                "rss": rss,
                "background_cores": cpu_delta(cpu0, background_cpu(me.pid)) / wall,
                "main_cores": (main_thread_cpu(me.pid) - main0) / wall,
                "loss": loss_ema,
                "params": sum(p.numel() for p in model.parameters()),
                "dynamo": "torch._dynamo.config" in sys.modules,
            }
        ),
        flush=True,
    )
    return 0


def run_bare(args: argparse.Namespace) -> list[dict]:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--bare-child",
        "--seconds",
        str(args.seconds),
        "--warmup",
        str(args.warmup),
        "--recipe",
        args.recipe,
        *(["--model", args.model] if args.model else []),
        *(["--data", str(args.data)] if args.data else []),
        "--batch",
        str(args.batch),
        "--threads",
        str(args.threads),
        *(["--bare-stand-in"] if args.bare_stand_in else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    procs = [
        subprocess.Popen(cmd + ["--seed", str(i + 1)], stdout=subprocess.PIPE, text=True, env=env)
        for i in range(args.peers)
    ]
    # the children's windows start after their imports and warm-up; meter most of it while they
    # all still run (an exited child's CPU time can no longer be read)
    time.sleep(args.warmup + 5)
    meter = LoadMeter()
    time.sleep(max(1.0, args.seconds - 5))
    results_load = meter.cores()
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=args.warmup + args.seconds + 300)
        if proc.returncode != 0:
            raise SystemExit(f"bare loop failed with exit code {proc.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    results[0]["external_cores"] = results_load
    return results


# ---- phase 2: the two-peer swarm -----------------------------------------------------------------


class WorkerView:
    def __init__(self, name: str):
        self.name = name
        self.lock = threading.Lock()
        self.state = "starting"
        self.maddrs: list[str] = []
        self.stats: list[tuple[float, int]] = []  # (arrival time, cumulative samples)
        self.progress = None
        self.errors: list = []
        self.training = threading.Event()

    def on_event(self, event) -> None:
        from dedloc_core.protocol import Error, Progress, State, Stats

        now = time.monotonic()
        with self.lock:
            if isinstance(event, Stats):
                self.stats.append((now, event.samples))
            elif isinstance(event, Progress):
                self.progress = event
            elif isinstance(event, State):
                self.state = event.state
                if event.maddrs:
                    self.maddrs = list(event.maddrs)
                if event.state == "training":
                    self.training.set()
            elif isinstance(event, Error):
                self.errors.append(event)
                if event.fatal:
                    self.training.set()

    def rate(self, t0: float, t1: float) -> float:
        """Samples/s between the first stats event at or after t0 and the last at or before t1."""
        with self.lock:
            window = [(t, s) for t, s in self.stats if t0 <= t <= t1]
        if len(window) < 2:
            return float("nan")
        (ta, sa), (tb, sb) = window[0], window[-1]
        return (sb - sa) / (tb - ta)


def experiment(args: argparse.Namespace) -> dict:
    from importlib import resources

    manifest = json.loads(resources.files("resources").joinpath("corpus", "manifest.json").read_text())
    return {
        "id": "overhead-bench",
        "title": "Overhead benchmark",
        "description": "bench/overhead.py",
        "organizer": "bench",
        "recipe": args.recipe,
        "recipe_params": recipe_params(args),
        "run_id": f"overhead_bench_{os.getpid()}",
        "initial_peers": [],
        "target_batch_size": TARGET_BATCH,
        "batch_size_per_step": args.batch,
        "matchmaking_time": 3.0,
        "averaging_timeout": 30.0,
        "hardware": {"ram_gb": 1, "cpu_cores": 1, "disk_gb": 1, "gpu_required": False},
        "data": prepared(args)["data"] if args.data else {
            "base_url": None,
            "shards": [
                {"url": f"data/{s['name']}", "sha256": s["sha256"], "size": s["size"]} for s in manifest["shards"]
            ],
        },
        "needs_token": False,
        "status": "active",
        "expires_at": None,
    }


def ready_line(log: Path) -> str:
    """The worker's own account of its start: imports, data, model build, swarm join, state."""
    found = re.search(r"Ready to train (.*)", log.read_text(errors="replace"))
    return found.group(1) if found else "not logged"


def run_swarm(args: argparse.Namespace, root: Path) -> dict:
    from importlib import resources

    from dedloc_core.organizer.httpserve import FileServer
    from dedloc_core.protocol import Limits, Start
    from dedloc_core.workerproc import WorkerProcess

    exp = experiment(args)
    workers: list[WorkerProcess] = []
    views: list[WorkerView] = []
    with resources.as_file(resources.files("resources").joinpath("corpus")) as corpus:
        server = FileServer()
        server.serve_dir("/data/", args.data or Path(corpus))
        with server:
            try:
                for i in range(args.peers):
                    home = root / f"peer{i}"
                    home.mkdir(parents=True, exist_ok=True)
                    view = WorkerView(f"peer{i}")
                    worker = WorkerProcess(
                        env={**os.environ, "DEDLOC_HOME": str(home), "DEDLOC_LOG_LEVEL": "INFO"},
                        stderr=open(home / "worker.log", "w"),  # closed with the process
                        on_event=view.on_event,
                    )
                    worker.start()
                    workers.append(worker)
                    views.append(view)
                    peers = views[0].maddrs if i > 0 else []
                    worker.send(
                        Start(
                            experiment=exp,
                            initial_peers=peers,
                            data_base_url=server.url,
                            identity_path=str(home / "identity.key"),
                            seed=i + 1,
                            limits=Limits(cpu_threads=args.threads),
                        )
                    )
                    if not view.training.wait(180) or view.errors:
                        raise SystemExit(
                            f"{view.name} did not start training: {view.errors or view.state}; "
                            f"see {home / 'worker.log'}"
                        )
                print(f"  swarm up ({args.peers} peers); warming up {args.warmup:.0f} s …", flush=True)
                time.sleep(args.warmup)
                pid = workers[0].pid
                t0 = time.monotonic()
                meter = LoadMeter()
                cpu0, main0 = background_cpu(pid), main_thread_cpu(pid)
                time.sleep(args.seconds / 2)
                mid = pss_bytes(tree(pid))
                time.sleep(args.seconds / 2)
                t1 = time.monotonic()
                external = meter.cores()
                cpu1, main1 = background_cpu(pid), main_thread_cpu(pid)
                end = pss_bytes(tree(pid))
                procs = {p.pid: p.name() for p in tree(pid)}
                memory = max(mid, end, key=lambda m: m[0])
                errors = [e for v in views for e in v.errors]
                num_peers = views[0].progress.num_peers if views[0].progress else 0
                return {
                    "sps": [v.rate(t0, t1) for v in views],
                    "pss": memory[0],
                    "rss": memory[1],
                    "memory": memory[2],
                    "processes": procs,
                    "background_cores": cpu_delta(cpu0, cpu1) / (t1 - t0),
                    "background_by_key": {k: (cpu1[k] - cpu0.get(k, 0.0)) / (t1 - t0) for k in cpu1},
                    "main_cores": (main1 - main0) / (t1 - t0),
                    "num_peers": num_peers,
                    "external_cores": external,
                    "errors": [f"{e.title}: {e.message}" for e in errors],
                    "ready": ready_line(root / "peer0" / "worker.log"),
                }
            finally:
                for worker in workers:
                    worker.stop(timeout=20)


# ---- report ---------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.bare_child:
        return bare_child(args)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dedloc-overhead-data-") as data:
        if args.recipe != "tiny-lm" and args.data is None:
            print("preparing token shards from the shipped corpus …", flush=True)
            prepare_data(args, Path(data))
        return measure(args, began)


def measure(args: argparse.Namespace, began: float) -> int:
    params = recipe_params(args)
    model = args.model or "d256x4" if args.recipe == "tiny-lm" else params.get("family")
    print(
        f"overhead bench: {args.recipe} {model}, micro-batch {args.batch}, {args.threads} thread(s) per process, "
        f"{args.peers} processes per phase, window {args.seconds:.0f} s after {args.warmup:.0f} s warm-up",
        flush=True,
    )
    bare = swarm = None
    if args.phase in ("both", "bare"):
        print("phase 1: bare torch loops …", flush=True)
        bare = run_bare(args)
    if args.phase in ("both", "swarm"):
        print("phase 2: swarm of workers …", flush=True)
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            swarm = run_swarm(args, args.keep)
        else:
            with tempfile.TemporaryDirectory(prefix="dedloc-overhead-") as tmp:
                swarm = run_swarm(args, Path(tmp))
    report(bare, swarm)
    print(f"bench wall time                   {time.monotonic() - began:.0f} s")
    if bare and swarm:
        print(f"overhead ratio: {mean(swarm['sps']) / mean([b['sps'] for b in bare]):.3f}")
    return 0


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def report(bare: list[dict] | None, swarm: dict | None) -> None:
    mb = 2**20
    print()
    if bare:
        b = bare[0]
        print(f"model parameters                  {b['params']:,}")
        print(
            f"bare samples/s (per process)      {' / '.join(format(x['sps'], '.2f') for x in bare)}  "
            f"(mean {mean(x['sps'] for x in bare):.2f})"
        )
    if swarm:
        print(
            f"swarm samples/s (per worker)      {' / '.join(format(x, '.2f') for x in swarm['sps'])}  "
            f"(mean {mean(swarm['sps']):.2f}), peers seen {swarm['num_peers']}"
        )
    if bare:
        print(f"bare process PSS / USS / RSS      {b['pss'] / mb:.0f} / {b['uss'] / mb:.0f} / {b['rss'] / mb:.0f} MiB"
              + ("" if b.get("dynamo") else " (torch._dynamo not imported: --bare-stand-in)"))
    if swarm:
        each = ", ".join(f"{n}[{pid}] {p / mb:.0f}/{u / mb:.0f}" for pid, n, p, u in swarm["memory"])
        print(
            f"worker tree PSS / RSS (sums)      {swarm['pss'] / mb:.0f} / {swarm['rss'] / mb:.0f} MiB "
            f"in {len(swarm['memory'])} processes"
        )
        print(f"  PSS/USS by process (MiB)        {each}")
        print(f"first worker ready                {swarm['ready']}")
    if bare and swarm:
        print(f"memory ratio (PSS)                {swarm['pss'] / b['pss']:.2f}x   (target <= 1.5x)")
    if bare:
        print(f"bare background cores             {b['background_cores']:.3f}   (main thread {b['main_cores']:.3f})")
    if swarm:
        names = swarm["processes"]
        top = sorted(swarm["background_by_key"].items(), key=lambda kv: -kv[1])
        text = ", ".join(
            f"{('thread ' + str(-k)) if k < 0 else f'{names.get(k, k)}[{k}]'} {v:.3f}" for k, v in top[:6] if v > 0.001
        )
        print(
            f"worker background cores           {swarm['background_cores']:.3f}   (target <= 0.1; "
            f"main thread {swarm['main_cores']:.3f})"
        )
        print(f"  biggest consumers (cores)       {text}")
    loads = [("bare", bare[0]["external_cores"])] if bare else []
    loads += [("swarm", swarm["external_cores"])] if swarm else []
    print("other load on the machine (cores) " + ", ".join(f"{n} phase {v:.2f}" for n, v in loads))
    if any(v > 0.1 for _, v in loads):
        print("WARNING: other programs used the CPU during a window; samples/s are not reliable, run again")
    if swarm and swarm["errors"]:
        print(f"worker errors                     {swarm['errors'][:3]}")


if __name__ == "__main__":
    sys.exit(main())
