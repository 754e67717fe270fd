"""Overhead of the volunteer worker (hivemind) against a bare torch loop, measured in one run.

    .venv/bin/python bench/overhead.py [--seconds 60] [--warmup 20] [--model d256x4] [--batch 8]
    .venv/bin/python bench/overhead.py --recipe causal-lm [--model '{"family": "gpt2", ...}']

``--recipe causal-lm`` or ``masked-lm`` measures a declared transformers model (llama by default,
albert for masked-lm) on token shards that ``dedloc data prepare`` makes of the shipped corpus first;
``--model`` JSON is merged into the prepared entry's recipe_params (``config`` key by key).

Two phases on the same machine, each with two processes of one torch thread (a two-peer swarm on a
2-core machine keeps both cores busy, so the bare side does too), all started once and run in turns:
slices of ``--seconds / --slices`` seconds, A B B A A B ..., the other phase stopped (SIGSTOP, the
whole process group of each worker) meanwhile, each slice counted after ``SETTLE_S`` of running. A
drift of the machine's speed over the run then weighs on both phases alike.

1. bare: a plain torch loop (forward, backward, optimizer step every target_batch/batch
   micro-batches, like hivemind's local accumulation) per subprocess, printing its samples after
   every micro-batch.
2. swarm: two real workers (``dedloc_core.engine.worker`` through ``WorkerProcess``), the first the other's
   initial peer, training the same model on the same micro-batch with a target batch so large
   that the run is pure gradient accumulation. The corpus is served over HTTP on loopback.
   Samples come from the workers' cumulative ``stats`` events (sent right after a micro-batch).

Per phase: samples/s over its slices, the PSS of the first process's whole tree (the worker's: python,
its forked averager processes, p2pd), and background CPU: the CPU time of every descendant plus the
process's non-main threads, over the slices' wall time.

The last line is ``overhead ratio: X`` with X = swarm samples/s / bare samples/s (means of the two
processes of each phase). Targets (bench/README.md): X >= 0.95, memory <= 1.5x, background <= 0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
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
SETTLE_S = 1.5  # seconds a phase runs after it was stopped before its slice counts (caches, timers)


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
    p.add_argument("--seconds", type=float, default=60.0, help="measured seconds per phase (default 60)")
    p.add_argument("--slices", type=int, default=6, help="slices per phase, interleaved (default 6)")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds the swarm trains before the slices (default 20)")
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
    """One bare torch loop: the worker's loop without hivemind. Prints a JSON line with the model's
    size, then ``monotonic samples`` after every micro-batch, until killed."""
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
    print(json.dumps({"params": sum(p.numel() for p in model.parameters()),
                      "dynamo": "torch._dynamo.config" in sys.modules}), flush=True)
    samples = steps = 0
    while True:
        batch = next(batches)
        loss = recipe.loss(model, batch)
        loss.backward()
        steps += 1
        if steps % accumulate == 0:
            opt.step()
            opt.zero_grad()
        samples += args.batch
        float(loss.detach())  # the worker reads its loss every micro-batch (a sync point on a GPU)
        print(f"{time.monotonic():.4f} {samples}", flush=True)


class BareLoop:
    """A bare child and the (monotonic, cumulative samples) pairs it prints."""

    def __init__(self, args: argparse.Namespace, seed: int):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--bare-child", "--recipe", args.recipe,
               *(["--model", args.model] if args.model else []), *(["--data", str(args.data)] if args.data else []),
               "--batch", str(args.batch), "--threads", str(args.threads), "--seed", str(seed),
               *(["--bare-stand-in"] if args.bare_stand_in else [])]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        self.pid = self.proc.pid
        self.info: dict = {}
        self.stats: list[tuple[float, int]] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.info = json.loads(line)
                self.ready.set()
            else:
                t, n = line.split()
                self.stats.append((float(t), int(n)))
        self.ready.set()

    def samples(self, t0: float, t1: float) -> tuple[int, float]:
        return samples_between(self.stats, t0, t1)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


def samples_between(stats: list[tuple[float, int]], t0: float, t1: float) -> tuple[int, float]:
    """(samples, seconds) between the first micro-batch end at or after t0 and the last at or before t1."""
    window = [(t, n) for t, n in list(stats) if t0 <= t <= t1]
    if len(window) < 2:
        return 0, 0.0
    return window[-1][1] - window[0][1], window[-1][0] - window[0][0]


# ---- phase 2: the two-peer swarm -----------------------------------------------------------------


class WorkerView:
    def __init__(self, name: str):
        self.name = name
        self.worker = None  # its WorkerProcess
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

    def samples(self, t0: float, t1: float) -> tuple[int, float]:
        with self.lock:
            return samples_between(self.stats, t0, t1)


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


def start_swarm(args: argparse.Namespace, root: Path, stack: contextlib.ExitStack) -> list[WorkerView]:
    """Two (``--peers``) real workers, the first the others' initial peer, training; stopped with ``stack``."""
    from importlib import resources

    from dedloc_core.organizer.httpserve import FileServer
    from dedloc_core.protocol import Limits, Start
    from dedloc_core.workerproc import WorkerProcess

    exp = experiment(args)
    views: list[WorkerView] = []
    corpus = stack.enter_context(resources.as_file(resources.files("resources").joinpath("corpus")))
    server = FileServer()
    server.serve_dir("/data/", args.data or Path(corpus))
    stack.enter_context(server)
    for i in range(args.peers):
        home = root / f"peer{i}"
        home.mkdir(parents=True, exist_ok=True)
        view = WorkerView(f"peer{i}")
        worker = WorkerProcess(env={**os.environ, "DEDLOC_HOME": str(home), "DEDLOC_LOG_LEVEL": "INFO"},
                               stderr=open(home / "worker.log", "w"), on_event=view.on_event)  # closed with it
        worker.start()
        stack.callback(worker.stop, timeout=20)
        view.worker = worker
        views.append(view)
        worker.send(Start(experiment=exp, initial_peers=views[0].maddrs if i > 0 else [], data_base_url=server.url,
                          identity_path=str(home / "identity.key"), seed=i + 1,
                          limits=Limits(cpu_threads=args.threads)))
        if not view.training.wait(180) or view.errors:
            raise SystemExit(f"{view.name} did not start training: {view.errors or view.state}; "
                             f"see {home / 'worker.log'}")
    return views


class Phase:
    """One side of the comparison: processes to run or stop together, and what its slices measured."""

    def __init__(self, name: str, pids: list[int], counters: list, groups: bool = False, **found):
        """``groups``: signal each pid's whole process group (a worker's helpers and p2pd too);
        ``found``: what the report reads besides the slices (``info``, ``views``, ``root``)."""
        self.name, self.pids, self.counters, self.groups = name, pids, counters, groups
        self.info, self.views, self.root = found.get("info", {}), found.get("views", []), found.get("root")
        self.processes: dict[int, str] = {}
        self.samples = [0] * len(counters)
        self.seconds = [0.0] * len(counters)
        self.wall = self.main = self.background = self.external = 0.0
        self.by_key: dict[int, float] = {}
        self.memory: tuple[int, int, list] = (0, 0, [])

    def signal(self, sig: int) -> None:
        for pid in self.pids:
            try:
                os.killpg(os.getpgid(pid), sig) if self.groups else os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def run_slice(self, settle: float, seconds: float) -> None:
        """Run alone for ``settle`` + ``seconds`` and add the last ``seconds``' figures; stopped after."""
        self.signal(signal.SIGCONT)
        time.sleep(settle)
        first = self.pids[0]
        t0, meter, cpu0, main0 = time.monotonic(), LoadMeter(), background_cpu(first), main_thread_cpu(first)
        time.sleep(seconds)
        t1 = time.monotonic()
        cpu1 = background_cpu(first)
        self.main += main_thread_cpu(first) - main0
        self.background += cpu_delta(cpu0, cpu1)
        for k, v in cpu1.items():
            self.by_key[k] = self.by_key.get(k, 0.0) + v - cpu0.get(k, 0.0)
        self.external += meter.cores() * (t1 - t0)
        self.wall += t1 - t0
        self.memory = max(self.memory, pss_bytes(tree(first)), key=lambda m: m[0])
        self.processes = {q.pid: q.name() for q in tree(first)}
        self.signal(signal.SIGSTOP)
        time.sleep(0.3)  # the last stats events of the slice arrive
        for i, counter in enumerate(self.counters):
            n, dt = counter.samples(t0, t1)
            self.samples[i] += n
            self.seconds[i] += dt

    def sps(self) -> list[float]:
        return [n / dt if dt else float("nan") for n, dt in zip(self.samples, self.seconds, strict=True)]


def order(slices: int, phases: list[Phase]) -> list[Phase]:
    """A B B A A B ...: each phase as often early as late in the run, so a drift of the machine's
    speed over the run weighs on both alike."""
    if len(phases) == 1:
        return phases * slices
    a, b = phases
    return [(a, b, b, a)[i % 4] for i in range(2 * slices)]


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
    slice_s = args.seconds / args.slices
    print(
        f"overhead bench: {args.recipe} {model}, micro-batch {args.batch}, {args.threads} thread(s) per process, "
        f"{args.peers} processes per phase, {args.seconds:.0f} s per phase in {args.slices} slices of "
        f"{slice_s:.0f} s, interleaved, after {args.warmup:.0f} s warm-up",
        flush=True,
    )
    phases: list[Phase] = []
    with contextlib.ExitStack() as stack:
        if args.phase in ("both", "bare"):
            bare = [BareLoop(args, seed=i + 1) for i in range(args.peers)]
            for loop in bare:
                stack.callback(loop.stop)
            for loop in bare:
                if not loop.ready.wait(180) or not loop.info:
                    raise SystemExit(f"the bare loop failed (exit code {loop.proc.poll()})")
            phases.append(Phase("bare", [loop.pid for loop in bare], bare, info=bare[0].info))
            phases[-1].signal(signal.SIGSTOP)
        if args.phase in ("both", "swarm"):
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
            root = args.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="dedloc-overhead-")))
            views = start_swarm(args, root, stack)
            phases.append(Phase("swarm", [v.worker.pid for v in views], views, groups=True, views=views, root=root))
            print(f"  swarm up ({args.peers} peers); warming up {args.warmup:.0f} s …", flush=True)
            time.sleep(args.warmup)
            phases[-1].signal(signal.SIGSTOP)
        if len(phases) == 2:  # the bare loops' first micro-batches
            phases[0].signal(signal.SIGCONT)
            time.sleep(min(args.warmup, 5.0))
            phases[0].signal(signal.SIGSTOP)
        for i, phase in enumerate(order(args.slices, phases)):
            phase.run_slice(SETTLE_S, slice_s)
            print(f"  slice {i + 1:2} {phase.name:5} {mean(phase.sps()):.2f} samples/s so far", flush=True)
        for phase in phases:
            phase.signal(signal.SIGCONT)  # stopping needs running processes
        found = {p.name: p for p in phases}
        report(found.get("bare"), found.get("swarm"))
    print(f"bench wall time                   {time.monotonic() - began:.0f} s")
    if len(phases) == 2:
        print(f"overhead ratio: {mean(found['swarm'].sps()) / mean(found['bare'].sps()):.3f}")
    return 0


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def report(bare: Phase | None, swarm: Phase | None) -> None:
    mb = 2**20
    print()
    if bare:
        print(f"model parameters                  {bare.info['params']:,}")
    for phase, who in ((bare, "process"), (swarm, "worker")):
        if phase:
            sps = phase.sps()
            print(f"{phase.name + ' samples/s (per ' + who + ')':34}{' / '.join(format(x, '.2f') for x in sps)}  "
                  f"(mean {mean(sps):.2f})")
    if bare:
        pss, rss, each = bare.memory
        print(f"bare process PSS / USS / RSS      {pss / mb:.0f} / {each[0][3] / mb:.0f} / {rss / mb:.0f} MiB"
              + ("" if bare.info.get("dynamo") else " (torch._dynamo not imported: --bare-stand-in)"))
    if swarm:
        pss, rss, each = swarm.memory
        text = ", ".join(f"{n}[{pid}] {p / mb:.0f}/{u / mb:.0f}" for pid, n, p, u in each)
        peers = swarm.views[0].progress.num_peers if swarm.views[0].progress else 0
        print(f"worker tree PSS / RSS (sums)      {pss / mb:.0f} / {rss / mb:.0f} MiB in {len(each)} processes, "
              f"peers seen {peers}")
        print(f"  PSS/USS by process (MiB)        {text}")
        print(f"first worker ready                {ready_line(swarm.root / 'peer0' / 'worker.log')}")
    if bare and swarm:
        print(f"memory ratio (PSS)                {swarm.memory[0] / bare.memory[0]:.2f}x   (target <= 1.5x)")
    if bare:
        print(f"bare background cores             {bare.background / bare.wall:.3f}   "
              f"(main thread {bare.main / bare.wall:.3f})")
    if swarm:
        names = swarm.processes
        top = sorted(swarm.by_key.items(), key=lambda kv: -kv[1])
        text = ", ".join(f"{('thread ' + str(-k)) if k < 0 else f'{names.get(k, k)}[{k}]'} {v / swarm.wall:.3f}"
                         for k, v in top[:6] if v / swarm.wall > 0.001)
        print(f"worker background cores           {swarm.background / swarm.wall:.3f}   (target <= 0.1; "
              f"main thread {swarm.main / swarm.wall:.3f})")
        print(f"  biggest consumers (cores)       {text}")
        errors = [f"{e.title}: {e.message}" for v in swarm.views for e in v.errors]
        if errors:
            print(f"worker errors                     {errors[:3]}")
    loads = [(p.name, p.external / p.wall) for p in (bare, swarm) if p]
    print("other load on the machine (cores) " + ", ".join(f"{n} phase {v:.2f}" for n, v in loads))
    if any(v > 0.1 for _, v in loads):
        print("WARNING: other programs used the CPU during a window; samples/s are not reliable, run again")


if __name__ == "__main__":
    sys.exit(main())
