"""``dedloc demo``: a backbone and a few volunteer workers on loopback, training together.

Shows a live progress line and, at the end, the first and last loss. Ends after ``--steps``
global steps or Ctrl-C and leaves no process behind.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from dedloc_core import environ
from dedloc_core.backboneproc import BackboneProcess
from dedloc_core.errors import EXIT_EXPLAINED, EXIT_INTERRUPTED, DedlocError, report, user_message
from dedloc_core.protocol import Error, Limits, Progress, Start, State
from dedloc_core.workerproc import WorkerProcess


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dedloc demo", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="global steps to train (default 20)")
    p.add_argument("--peers", type=int, default=2, help="number of volunteer workers (default 2)")
    p.add_argument("--experiment", default="tiny-lm-demo")
    p.add_argument("--catalog", type=Path, default=None,
                   help="an organizer's signed catalog to try the experiment from (default: the shipped one)")
    p.add_argument("--trusted-key", type=Path, action="append", default=[],
                   help="the public key that signed --catalog (repeatable)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="the experiment's data, served by the backbone at /data/ (dedloc data prepare's --out)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per worker")
    p.add_argument("--dir", type=Path, default=None, help="keep logs and state here (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=900.0, help="give up after this many seconds")
    p.add_argument("--stats-db", type=Path, default=None,
                   help="record the first volunteer's contribution in this stats file (as the app does)")
    return p.parse_args(argv)


@dataclass
class PeerView:
    state: str = "starting"
    progress: Progress | None = None
    first_loss: float | None = None
    errors: list[Error] = field(default_factory=list)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # a terminated demo cleans up like Ctrl-C
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
        return Demo(args, args.dir).run()
    with tempfile.TemporaryDirectory(prefix="dedloc-demo-") as tmp:
        return Demo(args, Path(tmp)).run()


class Demo:
    def __init__(self, args: argparse.Namespace, root: Path):
        self.args, self.root = args, root
        self.backbone: BackboneProcess | None = None
        self.workers: list[WorkerProcess] = []
        self.views: list[PeerView] = []
        self.recorder = None  # statsrecorder.StatsRecorder of the first volunteer, with --stats-db
        self.ready: dict = {}

    def run(self) -> int:
        began = time.monotonic()
        try:
            ready = self.ready = self._start_backbone()
            experiment = self._experiment()
            print(f"Backbone up at {ready['maddrs'][0]}; starting {self.args.peers} volunteers …", flush=True)
            for i in range(self.args.peers):
                self._start_worker(i, experiment, ready)
            return self._watch(began)
        except KeyboardInterrupt:
            print("\nInterrupted; stopping …", flush=True)
            self._summary(began)
            return EXIT_INTERRUPTED
        except DedlocError as exc:
            print(file=sys.stderr)
            return report(exc)
        finally:
            self._save_swarm()
            self._stop_all()
            if self.recorder is not None:
                self.recorder.close()

    def _experiment(self) -> dict:
        from dedloc_core.catalog import CatalogStore, load_trusted_keys, verify_catalog

        if self.args.catalog:  # an organizer trying their experiment before they publish it
            keys = {**load_trusted_keys(), **load_trusted_keys(self.args.trusted_key)}
            catalog = verify_catalog(self.args.catalog.read_bytes(), keys)
        else:
            catalog = CatalogStore(self.root / "catalog" / "last_good.json").load_default().catalog
        exp = catalog.get(self.args.experiment) if catalog else None
        if exp is None:
            raise DedlocError(f"No experiment {self.args.experiment!r} in the catalog.", title="Demo")
        return msgspec.to_builtins(exp)

    def _start_backbone(self) -> dict:
        extra = ["--follow-every", "5",  # loopback: load the swarm's state often, for the held-out curve
                 *(["--catalog", str(self.args.catalog)] if self.args.catalog else []),
                 *(a for key in self.args.trusted_key for a in ("--trusted-key", str(key))),
                 *(["--data-dir", str(self.args.data_dir)] if self.args.data_dir else [])]
        self.backbone = BackboneProcess(["--experiment", self.args.experiment, *extra], self.root / "backbone",
                                        self.root / "backbone.log",
                                        env={**os.environ, environ.HOME.name: str(self.root / "backbone-home")})
        return self.backbone.start(timeout=120)

    def _start_worker(self, i: int, experiment: dict, ready: dict) -> None:
        home = self.root / f"peer{i}"
        home.mkdir(exist_ok=True)
        view = PeerView()
        recorder = None
        if i == 0 and self.args.stats_db:
            from dedloc_core.stats.recorder import StatsRecorder

            recorder = self.recorder = StatsRecorder(self.args.stats_db, experiment["id"]).start()

        def on_event(event, v=view, r=recorder):
            self._on_event(v, event)
            if r is not None:
                r.on_event(event)

        worker = WorkerProcess(
            env={**os.environ, environ.HOME.name: str(home)},
            stderr=open(self.root / f"peer{i}.log", "w"),
            on_event=on_event,
        )
        worker.start()
        worker.send(Start(experiment=experiment, initial_peers=ready["maddrs"], data_base_url=ready["http_url"],
                          identity_path=str(home / "identity.key"), seed=i + 1,
                          limits=Limits(cpu_threads=self.args.threads), display_name=f"demo volunteer {i + 1}"))
        self.workers.append(worker)
        self.views.append(view)

    @staticmethod
    def _on_event(view: PeerView, event) -> None:
        if isinstance(event, State):
            view.state = event.state
        elif isinstance(event, Progress):
            view.progress = event
            if view.first_loss is None and event.loss is not None:
                view.first_loss = event.loss
        elif isinstance(event, Error):
            view.errors.append(event)

    def _watch(self, began: float) -> int:
        deadline = began + self.args.timeout
        while time.monotonic() < deadline:
            time.sleep(1.0)
            for view in self.views:
                fatal = [e for e in view.errors if e.fatal]
                if fatal:
                    print(f"\nA volunteer failed: {user_message(fatal[0]).line()}", file=sys.stderr)
                    return EXIT_EXPLAINED
            step = self._line()
            if step >= self.args.steps:
                print()
                self._summary(began)
                return 0
        print("\nTimed out.", file=sys.stderr)
        self._summary(began)
        return EXIT_EXPLAINED

    def _line(self) -> int:
        progress = [v.progress for v in self.views if v.progress]
        if not progress:
            states = ", ".join(v.state for v in self.views)
            print(f"\r{'waiting for volunteers: ' + states:<100}", end="", flush=True)
            return 0
        step = max(p.global_step for p in progress)
        swarm = max(p.swarm_samples_per_second for p in progress)
        losses = [p.loss for p in progress if p.loss is not None]
        loss = f"{sum(losses) / len(losses):.3f}" if losses else "—"
        peers = max(p.num_peers for p in progress)
        acc = max(p.samples_accumulated for p in progress)
        line = (f"step {step}/{self.args.steps} · swarm {swarm:.1f} samples/s · loss {loss} · "
                f"peers {peers} · batch {acc}/{progress[0].target_batch_size}")
        print(f"\r{line:<100}", end="", flush=True)
        return step

    def _summary(self, began: float) -> None:
        firsts = [v.first_loss for v in self.views if v.first_loss is not None]
        lasts = [v.progress.loss for v in self.views if v.progress and v.progress.loss is not None]
        steps = max((v.progress.global_step for v in self.views if v.progress), default=0)
        if not firsts or not lasts:
            print("No loss reported yet.")
            return
        first, last = sum(firsts) / len(firsts), sum(lasts) / len(lasts)
        print(f"Trained {steps} global steps with {len(self.views)} volunteers in "
              f"{time.monotonic() - began:.0f} s.")
        print(f"First loss: {first:.3f}   Last loss: {last:.3f}   ({'falling' if last < first else 'NOT falling'})")

    def _save_swarm(self) -> None:
        """Keep the backbone's last swarm summary as ``swarm.json`` in the demo's directory."""
        url = self.ready.get("http_url")
        if not url or self.backbone is None or not self.backbone.running():
            return
        from dedloc_core.stats.swarmview import SwarmUnavailable, fetch_summary

        reached = max((v.progress.global_step for v in self.views if v.progress), default=0)
        deadline = time.monotonic() + 30  # the backbone records every few seconds: let it catch up
        while True:
            try:
                summary = fetch_summary(url + "swarm.json", timeout=5)
            except SwarmUnavailable as exc:
                report(exc)
                return
            if summary.global_step >= reached or time.monotonic() > deadline:
                break
            time.sleep(1)
        (self.root / "swarm.json").write_bytes(msgspec.json.format(msgspec.json.encode(summary), indent=1))
        board = ", ".join(f"{c.name}: {c.samples}" for c in summary.leaderboard)
        print(f"Swarm at step {summary.global_step}; leaderboard: {board or '(empty)'}")

    def _stop_all(self) -> None:
        for worker in self.workers:
            worker.send_line('{"v":1,"type":"stop"}')
        for worker in self.workers:
            worker.stop(timeout=20)
        if self.backbone is not None:
            self.backbone.stop(timeout=30)  # it saves a checkpoint and shuts hivemind down


if __name__ == "__main__":
    sys.exit(main())
