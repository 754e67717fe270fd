"""Pause latency: how fast a training worker stops using the CPU when the user touches the computer.

    .venv/bin/python bench/pause_latency.py [--trials 10] [--tick 0.1] [--idle 2]

Under a real X server (Xvfb), a real worker (``dedloc_core.engine.worker``, tiny-lm, solo swarm) trains
while the policy loop of the app runs here: a ``Contributor`` reading X11 idle time
(``XScreenSaverQueryInfo``) every ``--tick`` seconds, with "in use" meaning input in the last
``--idle`` seconds (the app's default is 3 minutes; shorter here so trials do not wait).
Each trial waits until the worker trains at full speed, moves the mouse with ``xdotool``, and
measures the time from the input until the worker process's CPU use falls below 5% of one core:
the start of the first 100 ms window in which it used under 5 ms of CPU (sampled with psutil every
10 ms). The time includes detection (tick), the ``pause`` command over the pipe, and the training
loop reaching its pause gate (between micro-batches or in a forward/backward hook).

Prints each trial, p50 and p95; the last line is ``pause p95 ms: X``. Target: X <= 250.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WINDOW = 0.1  # seconds: the CPU-use window
QUIET = 0.05  # under 5% of one core over the window
PERIOD = 0.01


def experiment() -> dict:
    manifest = json.loads(resources.files("resources").joinpath("corpus", "manifest.json").read_text())
    return {
        "id": "pause-bench", "title": "Pause latency benchmark", "description": "bench/pause_latency.py",
        "organizer": "bench", "recipe": "tiny-lm",
        "recipe_params": {"d_model": 128, "n_layers": 2, "n_heads": 2, "seq_len": 64, "warmup_steps": 0},
        "run_id": f"pause_bench_{os.getpid()}", "initial_peers": [], "target_batch_size": 10_000_000,
        "batch_size_per_step": 8, "matchmaking_time": 3.0, "averaging_timeout": 30.0,
        "hardware": {"ram_gb": 1, "cpu_cores": 1, "disk_gb": 1, "gpu_required": False},
        "data": {"base_url": None, "shards": [
            {"url": f"data/{s['name']}", "sha256": s["sha256"], "size": s["size"]} for s in manifest["shards"][:2]]},
        "needs_token": False, "status": "active", "expires_at": None,
    }


@contextlib.contextmanager
def xvfb():
    """Xvfb on a free display; yields ``:N``."""
    for n in range(90, 200):
        if not Path(f"/tmp/.X11-unix/X{n}").exists() and not Path(f"/tmp/.X{n}-lock").exists():
            break
    display = f":{n}"
    proc = subprocess.Popen(["Xvfb", display, "-screen", "0", "1280x800x24", "-nolisten", "tcp", "-noreset"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while subprocess.run(["xdpyinfo", "-display", display], capture_output=True).returncode != 0:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("Xvfb did not start")
            time.sleep(0.1)
        yield display
    finally:
        proc.terminate()
        proc.wait(5)


def sample_ahead() -> None:
    """Put the calling sampler thread above the load it measures (root only; else it stays). Starved
    by a worker importing torch beside a training volunteer, it sampled late, and a worker that the
    app stopped 22-34 ms after the input (the app's own clock) read as busy for 130-170 ms."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), -10)
    except OSError:
        pass


class CpuMeter:
    """Samples one process's CPU time every ``PERIOD`` s in a thread: [(monotonic, cpu seconds)]."""

    def __init__(self, pid: int):
        self.proc = psutil.Process(pid)
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sample_ahead()
        while not self._stop.is_set():
            try:
                t = self.proc.cpu_times()
            except psutil.Error:
                return
            self.samples.append((time.monotonic(), t.user + t.system))
            del self.samples[:-3000]
            time.sleep(PERIOD)

    def rate(self, since: float, until: float) -> float:
        """CPU cores used between two moments (from the nearest samples)."""
        window = [s for s in self.samples if since <= s[0] <= until]
        if len(window) < 2:
            return float("nan")
        (t0, c0), (t1, c1) = window[0], window[-1]
        return (c1 - c0) / max(t1 - t0, 1e-6)

    def quiet_after(self, t_input: float, timeout: float = 5.0) -> float | None:
        """Seconds from ``t_input`` to the start of the first quiet window, waiting up to ``timeout``."""
        deadline = t_input + timeout
        while time.monotonic() < deadline:
            samples = [s for s in self.samples if s[0] >= t_input]
            for i, (t0, c0) in enumerate(samples):
                end = next((s for s in samples[i:] if s[0] >= t0 + WINDOW), None)
                if end is None:
                    break
                if (end[1] - c0) / (end[0] - t0) < QUIET:
                    return t0 - t_input
            time.sleep(0.05)
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class PolicyLoop:
    """The app's policy loop in miniature: a Contributor ticking on a thread, acting on the worker."""

    def __init__(self, worker, tick: float, idle_seconds: float):
        from msgspec.structs import replace

        from dedloc_core.policy import idle
        from dedloc_core.policy.contributor import Contributor
        from dedloc_core.policy.sampler import GpuProbe, Sampler
        from dedloc_core.prefs import Preferences

        source = idle.X11Idle()
        # replace does not validate: an "in use" threshold of seconds instead of minutes
        prefs = replace(Preferences(), idle_minutes=idle_seconds / 60, other_cpu_limit=None)
        self.source = source
        self.contributor = Contributor(prefs, Sampler(source, GpuProbe(), own_pids=lambda: [worker.pid]))
        self.worker, self.tick = worker, tick
        self.running = threading.Event()  # last action: run
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from dedloc_core import protocol
        from dedloc_core.policy import contributor as c

        while not self._stop.is_set():
            for action in self.contributor.tick():
                if isinstance(action, (c.StartWorker, c.Resume)):  # the worker was started paused
                    limits = getattr(action, "limits", None)
                    if limits is not None:
                        self.worker.send(protocol.SetLimits(limits=limits))
                    self.worker.send(protocol.Resume())
                    self.running.set()
                elif isinstance(action, c.Pause):
                    self.worker.send(protocol.Pause(reason=action.reason))
                    self.running.clear()
                elif isinstance(action, c.SetLimits):
                    self.worker.send(protocol.SetLimits(limits=action.limits))
            self._stop.wait(self.tick)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.source.close()  # before Xvfb goes: Xlib exits the process on a lost display


def xdotool(display: str, *args: str) -> None:
    subprocess.run(["xdotool", *args], env={**os.environ, "DISPLAY": display}, check=True, timeout=10)


def measure(trials: int = 10, tick: float = 0.1, idle_seconds: float = 2.0, log=print,
            home: Path | None = None, nice: int = 19, on_ready=None) -> list[float]:
    """Run the trials; return the latencies in seconds (raises SystemExit on a setup failure)."""
    for tool in ("Xvfb", "xdpyinfo", "xdotool"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed (apt-get install xvfb x11-utils xdotool)")
    from dedloc_core.organizer.httpserve import FileServer
    from dedloc_core.protocol import Limits, Start
    from dedloc_core.workerproc import WorkerProcess

    root = Path(home or tempfile.mkdtemp(prefix="pause-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    latencies: list[float] = []
    with xvfb() as display, resources.as_file(resources.files("resources").joinpath("corpus")) as corpus:
        os.environ["DISPLAY"] = display
        server = FileServer()
        server.serve_dir("/data/", Path(corpus))
        with server:
            env = {**os.environ, "DEDLOC_HOME": str(root), "DEDLOC_LOG_LEVEL": "WARNING",
                   "DEDLOC_WORKER_NICE": str(nice)}
            worker = WorkerProcess(env=env,
                                   stderr=open(root / "worker.log", "w"))
            worker.start()
            loop = meter = None
            try:
                worker.send(Start(experiment=experiment(), data_base_url=server.url, start_paused=True,
                                  identity_path=str(root / "identity.key"), limits=Limits(cpu_threads=1)))
                if worker.wait_for(lambda e: e.type == "state" and e.state == "paused", 180) is None:
                    raise SystemExit(f"the worker did not start; see {root / 'worker.log'}")
                if on_ready is not None:
                    on_ready(worker)
                meter = CpuMeter(worker.pid)
                loop = PolicyLoop(worker, tick, idle_seconds)
                for trial in range(trials):
                    # wait until the user counts as away, the worker runs, and it trains at full speed
                    deadline = time.monotonic() + 120
                    while True:
                        now = time.monotonic()
                        if loop.running.is_set() and meter.rate(now - 0.5, now) > 0.3:
                            break
                        if now > deadline:
                            raise SystemExit(f"the worker did not train; see {root / 'worker.log'}")
                        time.sleep(0.05)
                    time.sleep(random.uniform(0.0, 0.3))  # input at a random point of a micro-batch
                    t_input = time.monotonic()
                    xdotool(display, "mousemove", str(random.randint(0, 1200)), str(random.randint(0, 700)))
                    latency = meter.quiet_after(t_input)
                    if latency is None:
                        raise SystemExit("the worker kept using the CPU for 5 s after input")
                    time.sleep(0.6)
                    paused_cpu = meter.rate(t_input + latency, time.monotonic())
                    latencies.append(latency)
                    log(f"  trial {trial + 1}: {latency * 1000:.0f} ms "
                        f"(then {paused_cpu * 100:.1f}% of a core while paused)")
            finally:
                if loop is not None:
                    loop.close()
                if meter is not None:
                    meter.close()
                worker.stop(timeout=20)
    return latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    low = int(k)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--tick", type=float, default=0.1, help="policy loop period, seconds (default 0.1)")
    p.add_argument("--idle", type=float, default=2.0, help="seconds without input that count as away")
    p.add_argument("--nice", type=int, default=19, help="the worker's nice value (default 19, as in the app)")
    args = p.parse_args(argv)
    print(f"pause latency: {args.trials} trials, policy tick {args.tick * 1000:.0f} ms", flush=True)
    latencies = measure(args.trials, args.tick, args.idle, log=lambda s: print(s, flush=True), nice=args.nice)
    print(f"pause p50 ms: {percentile(latencies, 0.5) * 1000:.0f}")
    print(f"pause max ms: {max(latencies) * 1000:.0f}")
    print(f"pause p95 ms: {percentile(latencies, 0.95) * 1000:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
