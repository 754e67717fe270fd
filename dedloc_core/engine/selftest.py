"""``dedloc --self-test``: does this installation work, start to end, on this computer alone?

Steps, each printed as it passes: the shipped catalog verifies against the shipped trusted keys; the
hardware probe; a worker process (a frozen build re-runs itself with ``--worker``); a DHT on
127.0.0.1 with no other peer; a few global steps of ``tiny-lm`` on the shipped corpus, fetched over
HTTP from 127.0.0.1 and verified; a clean stop. Exit 0 when all pass; otherwise 1 and the failing
step with its reason. Nothing is written outside a temporary directory.

An organizer checks that this client builds and trains their experiment with ``--catalog SIGNED.json
--trusted-key KEY.pub --experiment ID --data-dir SHARDS`` (``dedloc data prepare``'s output).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import msgspec

from dedloc_core import __version__, environ, paths
from dedloc_core.errors import DedlocError, report, user_message
from dedloc_core.protocol import Error, Limits, Progress, Start, State
from dedloc_core.workerproc import StopResult, WorkerProcess

EXPERIMENT = "tiny-lm-demo"
# Smaller than the catalog's tiny-lm so a few global steps take seconds on one CPU core.
SMALL = {"d_model": 64, "n_layers": 2, "n_heads": 2, "seq_len": 64, "lr": 0.003, "warmup_steps": 0}
BATCH = 8
MICRO_BATCHES_PER_STEP = 4


class SelfTestFailed(DedlocError):
    def __init__(self, step: str, message: str, hint: str = ""):
        super().__init__(message, title=f"Self-test failed at: {step}", code="selftest", hint=hint or
                         "Run it again with --keep DIR to keep the worker's log, and report the failing step.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dedloc --self-test", description=__doc__.splitlines()[0])
    p.add_argument("--experiment", default=EXPERIMENT,
                   help=f"an experiment of the shipped catalog (default {EXPERIMENT})")
    p.add_argument("--catalog", type=Path, default=None,
                   help="an organizer's signed catalog to take the experiment from (default: the shipped one)")
    p.add_argument("--trusted-key", type=Path, action="append", default=[],
                   help="the public key that signed --catalog (repeatable)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="the experiment's data, served at /data/ (default: the shipped corpus)")
    p.add_argument("--steps", type=int, default=2, help="global training steps to reach (default 2)")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    p.add_argument("--keep", type=Path, default=None, help="keep the worker's files and log here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.monotonic()
    build = "frozen build" if _frozen() else "Python " + sys.version.split()[0]
    print(f"DeDLOC Volunteer {__version__} self-test ({build})", flush=True)
    try:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            run(args, args.keep)
        else:
            with tempfile.TemporaryDirectory(prefix="dedloc-selftest-") as tmp:
                run(args, Path(tmp))
    except (DedlocError, KeyboardInterrupt) as exc:
        print(file=sys.stderr)
        return report(exc)
    print(f"Self-test passed in {time.monotonic() - began:.1f} s.", flush=True)
    return 0


def _frozen() -> bool:
    return bool(getattr(sys, "frozen", False))


def _ok(step: str, detail: str = "") -> None:
    print(f"  ok  {step}{': ' + detail if detail else ''}", flush=True)


def run(args: argparse.Namespace, root: Path) -> None:
    experiment = _experiment(root, args)
    which = f"{args.catalog.name} verified" if args.catalog else "signed default catalog verified"
    _ok("catalog", f"{which}; experiment {args.experiment!r}")
    _hardware(root)
    with resources.as_file(paths.resource("corpus")) as corpus:
        from dedloc_core.organizer.httpserve import FileServer

        with FileServer() as server:
            server.serve_dir("/data/", args.data_dir or Path(corpus))
            _ok("data", f"{args.data_dir or 'corpus'} served at {server.url}")
            _train(args, root, experiment, server.url)


def _experiment(root: Path, args: argparse.Namespace) -> dict:
    from dedloc_core.catalog import CatalogStore, load_trusted_keys, verify_catalog

    if args.catalog:
        try:
            keys = {**load_trusted_keys(), **load_trusted_keys(args.trusted_key)}
            catalog = verify_catalog(args.catalog.read_bytes(), keys)
        except (DedlocError, OSError) as exc:
            raise SelfTestFailed("catalog", exc.message if isinstance(exc, DedlocError) else str(exc),
                                 hint="Give the signed catalog's file and, with --trusted-key, the .pub key "
                                      "that signed it.") from exc
        where = str(args.catalog)
    else:
        result = CatalogStore(root / "last_good.json").load_default()
        if result.catalog is None or result.source != "default":
            reason = result.error.message if result.error else "no catalog"
            raise SelfTestFailed("catalog", f"The shipped catalog is unusable: {reason}")
        catalog, where = result.catalog, "The shipped catalog"
    exp_id = args.experiment
    exp = catalog.get(exp_id)
    if exp is None:
        known = ", ".join(e.id for e in catalog.experiments)
        raise SelfTestFailed("catalog", f"{where} has no experiment {exp_id!r} (it has {known}).")
    data = msgspec.to_builtins(exp)
    if exp.recipe == "tiny-lm":
        data["recipe_params"] = SMALL
    data.update(status="active", run_id=f"selftest_{os.getpid()}", batch_size_per_step=BATCH,
                target_batch_size=BATCH * MICRO_BATCHES_PER_STEP, matchmaking_time=1.0, averaging_timeout=10.0)
    return data


def _hardware(root: Path) -> None:
    from dedloc_core.policy.hardware import probe

    try:
        hw = probe(root)
    except Exception as exc:  # any probe failure fails this step, in words
        raise SelfTestFailed("hardware", f"{type(exc).__name__}: {exc}") from exc
    gpus = ", ".join(f"{g.name} ({g.memory_mb} MB)" for g in hw.gpus) or hw.gpu_note
    _ok("hardware", f"{hw.cpu_model}, {hw.cores} cores / {hw.threads} threads, {hw.ram_gb:.1f} GB RAM, "
                    f"{hw.disk_free_gb:.0f} GB free; {gpus}")


def _train(args: argparse.Namespace, root: Path, experiment: dict, data_url: str) -> None:
    home = root / "worker"
    home.mkdir(exist_ok=True)
    log_path = root / "worker.log"
    deadline = time.monotonic() + args.timeout
    with open(log_path, "w") as log:
        worker = WorkerProcess(env={**os.environ, environ.HOME.name: str(home), environ.LOG_LEVEL.name: "WARNING"},
                               stderr=log)
        try:
            try:
                hello = worker.start(hello_timeout=min(120.0, args.timeout))
            except DedlocError as exc:
                raise SelfTestFailed("worker", f"{exc.message} See {log_path}." if args.keep else exc.message) from exc
            _ok("worker", f"process {hello.pid} (protocol {hello.protocol})")
            worker.send(Start(experiment=experiment, initial_peers=[], data_base_url=data_url,
                              identity_path=str(home / "identity.key"), progress_period=0.5,
                              limits=Limits(cpu_threads=1)))
            _watch(args, worker, deadline, experiment)
        except SelfTestFailed as exc:
            tail = _tail(log_path)
            if tail:
                exc.message += "\n  Last lines of the worker's log:\n" + tail
            raise
        finally:
            result = worker.stop(timeout=20)
    if result is StopResult.KILLED:
        raise SelfTestFailed("stop", "The worker did not stop when asked and had to be killed.")
    _ok("stop", f"worker {result.value}")


def _watch(args: argparse.Namespace, worker: WorkerProcess, deadline: float, experiment: dict) -> None:
    step = "joining"
    first_loss = None
    while True:
        left = max(0.0, deadline - time.monotonic())
        event = worker.wait_for(lambda e: isinstance(e, State | Progress | Error), left)
        if event is None:
            if not worker.running():
                raise SelfTestFailed(step, f"The worker exited (code {worker.proc.poll() if worker.proc else '?'}).")
            raise SelfTestFailed(step, f"Timed out after {args.timeout:g} s.")
        if isinstance(event, Error):
            if event.fatal:
                raise SelfTestFailed(step, user_message(event).line())
            continue
        if isinstance(event, State):
            if event.state == "training" and step == "joining":
                local = [m for m in event.maddrs if "/ip4/127.0.0.1/" in m]
                if not local:
                    raise SelfTestFailed("DHT", f"The DHT is not listening on 127.0.0.1: {event.maddrs}")
                _ok("DHT", f"peer {event.peer_id} at {local[0]}")
                step = "training"
            elif event.state == "stopped":
                raise SelfTestFailed(step, f"The worker stopped: {event.reason}")
            continue
        if event.loss is not None and not math.isfinite(event.loss):
            raise SelfTestFailed("training", f"The loss is {event.loss}.")
        if first_loss is None and event.loss is not None:
            first_loss = event.loss
        if event.local_epoch >= args.steps:
            plural = "s" if event.local_epoch != 1 else ""
            _ok("training", f"{event.local_epoch} global step{plural} of {experiment['recipe']} alone, "
                            f"loss {first_loss:.3f} -> {event.loss:.3f}, {event.samples_per_second:.0f} samples/s")
            return


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "\n".join("    " + line for line in text)


if __name__ == "__main__":
    sys.exit(main())
