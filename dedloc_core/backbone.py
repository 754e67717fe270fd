"""The organizer's backbone node (``dedloc backbone``): headless, no GPU needed.

It bootstraps the DHT with a stable identity and given listen/announce addresses, relays for peers
behind NAT (p2pd's relay service), keeps the latest training state (it loads the swarm's state after
each global step, serves it to newcomers and writes a checkpoint atomically every N steps), records
the learning curve and per-peer contributions that peers publish in the DHT, and serves the signed
catalog and the data shards over HTTP. On restart it resumes from its last checkpoint.

Files in ``--run-dir``: ``identity.key``, ``checkpoint.pt``, ``learning_curve.jsonl``,
``contributions.csv`` and ``ready.json`` (addresses, written once the node is up). ``/swarm.json``
serves the swarm's summary (global step, samples/s, peers, learning curve, leaderboard; see
``swarmview``).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from importlib import resources
from pathlib import Path

from . import paths
from .errors import DedlocError

logger = logging.getLogger(__name__)

RECORD_PERIOD = 5.0  # seconds between reads of the peers' metrics


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dedloc backbone", description=__doc__.splitlines()[0])
    p.add_argument("--experiment", default="tiny-lm-demo", help="experiment id in the catalog")
    p.add_argument("--catalog", type=Path, help="signed catalog to publish (default: the shipped one)")
    p.add_argument("--trusted-key", type=Path, action="append", default=[], help="extra trusted public key")
    p.add_argument("--run-dir", type=Path, default=None, help="state directory (default: user data dir)")
    p.add_argument("--listen", action="append", default=[], help="listen multiaddr (repeatable)")
    p.add_argument("--announce", action="append", default=[], help="announced multiaddr (repeatable)")
    p.add_argument("--initial-peer", action="append", default=[], help="other backbones to join")
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=0, help="0 picks a free port; -1 disables HTTP")
    p.add_argument("--data-dir", type=Path, default=None, help="served at /data/ (default: the shipped corpus)")
    p.add_argument("--checkpoint-every", type=int, default=5, help="global steps between checkpoints")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between checks of the swarm")
    p.add_argument("--ready-file", type=Path, default=None)
    p.add_argument("--no-relay", action="store_true",
                   help="do not relay for volunteers behind NAT (they join outbound only)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("DEDLOC_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s [backbone] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return Backbone(args).run()
    except DedlocError as exc:
        logger.error("%s: %s", exc.title, exc.message)
        return 3


class Backbone:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.run_dir = args.run_dir or (paths.data_dir() / "backbone" / args.experiment)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.stop = threading.Event()

    def _load_catalog(self) -> tuple[bytes, object]:
        from .catalog import load_trusted_keys, verify_catalog

        keys = load_trusted_keys()
        keys.update(load_trusted_keys(self.args.trusted_key) if self.args.trusted_key else {})
        if self.args.catalog:
            data = self.args.catalog.read_bytes()
        else:
            data = paths.resource("catalog", "default.json").read_bytes()
        catalog = verify_catalog(data, keys)
        experiment = catalog.get(self.args.experiment)
        if experiment is None:
            raise DedlocError(f"No experiment {self.args.experiment!r} in the catalog.", title="Unknown experiment")
        return data, experiment

    def run(self) -> int:
        from .swarmview import SwarmView

        catalog_bytes, exp = self._load_catalog()
        self.view = SwarmView.load(self.run_dir, exp.run_id)
        with ExitStack() as stack:
            http_url = None
            if self.args.http_port >= 0:
                http_url = self._serve_http(stack, catalog_bytes)
            self._train_keeper(exp, http_url)
        return 0

    def _serve_http(self, stack: ExitStack, catalog_bytes: bytes) -> str:
        from .httpserve import FileServer

        server = FileServer({"/catalog.json": catalog_bytes, "/swarm.json": self.view.to_json},
                            host=self.args.http_host, port=self.args.http_port)
        data_dir = self.args.data_dir
        if data_dir is None:
            data_dir = stack.enter_context(resources.as_file(paths.resource("corpus")))
        server.serve_dir("/data/", Path(data_dir))
        stack.enter_context(server)
        logger.info("Serving the catalog and data at %s", server.url)
        return server.url

    def _train_keeper(self, exp, http_url: str | None) -> None:
        import torch

        from . import metrics, swarm
        from .recipes import load_recipe

        swarm.prepare_process()
        recipe = load_recipe(exp.recipe, exp.recipe_params)
        model = recipe.build_model(seed=0)
        cfg = swarm.SwarmConfig(
            run_id=exp.run_id,
            target_batch_size=exp.target_batch_size,
            batch_size_per_step=exp.batch_size_per_step,
            initial_peers=self.args.initial_peer,
            host_maddrs=self.args.listen or ["/ip4/127.0.0.1/tcp/0"],
            announce_maddrs=self.args.announce,
            identity_path=str(self.run_dir / "identity.key"),
            matchmaking_time=exp.matchmaking_time,
            averaging_timeout=exp.averaging_timeout,
            relay_service=not self.args.no_relay,  # the backbone relays for volunteers behind NAT; they do not
        )
        dht = swarm.start_dht(cfg)
        from .reachability import serve_dialback

        serve_dialback(dht)  # volunteers ask us whether we can reach them
        metrics.add_validators(dht, exp.run_id)
        keeper = _keeper(exp, dht, cfg, model, recipe)
        opt = keeper.opt
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stop.set())
        checkpoint = Checkpoint(self.run_dir / "checkpoint.pt", torch)
        checkpoint.restore(model, keeper)
        recorder = Recorder(self.run_dir, self.view)
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        self._write_ready({"peer_id": str(dht.peer_id), "maddrs": maddrs, "http_url": http_url,
                           "run_id": exp.run_id, "pid": os.getpid(), "epoch": opt.local_epoch, "mode": exp.mode})
        logger.info("Backbone up (%s mode): %s", exp.mode, " ".join(maddrs))
        last_saved = opt.local_epoch
        next_record = 0.0
        try:
            while not self.stop.wait(self.args.poll):
                if keeper.catch_up():
                    logger.info("Caught up with global step %d", opt.local_epoch)
                if opt.local_epoch >= last_saved + self.args.checkpoint_every:
                    checkpoint.save(model, keeper)
                    last_saved = opt.local_epoch
                if time.monotonic() >= next_record:
                    recorder.record(keeper.step(), keeper.num_peers(), metrics.fetch(dht, exp.run_id))
                    next_record = time.monotonic() + RECORD_PERIOD
        finally:
            if opt.local_epoch > last_saved:
                checkpoint.save(model, keeper)
            opt.shutdown()
            dht.shutdown()
            from .training import kill_children

            kill_children()

    def _write_ready(self, info: dict) -> None:
        path = self.args.ready_file or (self.run_dir / "ready.json")
        paths.atomic_write(path, json.dumps(info).encode())


class Checkpoint:
    """The model, optimizer state and epoch, written atomically."""

    def __init__(self, path: Path, torch):
        self.path, self.torch = path, torch

    def save(self, model, keeper) -> None:
        buf = tempfile.NamedTemporaryFile(dir=self.path.parent, prefix=".ckpt.", delete=False)
        try:
            with buf:
                self.torch.save({"model": model.state_dict(), "optimizer": keeper.opt.state_dict(),
                                 "epoch": keeper.opt.local_epoch, "mode": keeper.mode}, buf)
                buf.flush()
                os.fsync(buf.fileno())
            os.replace(buf.name, self.path)
        except BaseException:
            Path(buf.name).unlink(missing_ok=True)
            raise
        logger.info("Checkpoint saved at global step %d", keeper.opt.local_epoch)

    def restore(self, model, keeper) -> None:
        if not self.path.exists():
            return
        try:
            state = self.torch.load(self.path, map_location="cpu", weights_only=True)
            if state.get("mode", "sync") != keeper.mode:
                raise ValueError(f"it was written in {state.get('mode', 'sync')} mode")
            model.load_state_dict(state["model"])
            keeper.opt.load_state_dict(state["optimizer"])
        except Exception as exc:  # noqa: BLE001 - a bad checkpoint must not stop the node
            logger.error("Ignoring unreadable checkpoint %s: %s", self.path, exc)
            return
        keeper.restored(state["epoch"])
        logger.info("Restored checkpoint at global step %d", state["epoch"])


def _keeper(exp, dht, cfg, model, recipe):
    if exp.mode == "diloco":
        return DilocoKeeper(exp, dht, cfg, model, recipe)
    return SyncKeeper(dht, cfg, model, recipe)


class SyncKeeper:
    """Follows a synchronous (DeDLOC) swarm with a hivemind.Optimizer that never steps."""

    mode = "sync"

    def __init__(self, dht, cfg, model, recipe):
        from . import swarm

        self.opt = swarm.build_optimizer(dht, cfg, model, recipe)

    def catch_up(self) -> bool:
        if self.opt.tracker.global_epoch > self.opt.local_epoch:
            self.opt.load_state_from_peers()
            return True
        return False

    def step(self) -> int:
        return max(self.opt.tracker.global_epoch, self.opt.local_epoch)

    def num_peers(self) -> int:
        return self.opt.tracker.global_progress.num_peers

    def restored(self, epoch: int) -> None:
        self.opt.state_averager.local_epoch = epoch
        self.opt.tracker.update_epoch(epoch)
        self.opt.state_averager.state_sharing_priority = epoch


class DilocoKeeper:
    """Follows a DiLoCo swarm's outer model (``DilocoOptimizer`` as a follower: it never trains, never
    joins a round, and does not announce itself, so no round waits for it); serves it to newcomers."""

    mode = "diloco"

    def __init__(self, exp, dht, cfg, model, recipe):
        from .diloco import DilocoOptimizer

        self.opt = DilocoOptimizer(dht, exp.run_id, model, recipe, exp.diloco, batch_size=exp.batch_size_per_step,
                                   matchmaking_time=cfg.matchmaking_time, averaging_timeout=cfg.averaging_timeout,
                                   follower=True)

    def catch_up(self) -> bool:
        return self.opt.follow()

    def step(self) -> int:
        return self.opt.local_epoch

    def num_peers(self) -> int:
        return self.opt.swarm_size()

    def restored(self, epoch: int) -> None:
        pass  # load_state_dict set the round


class Recorder:
    """Appends the learning curve (JSON lines) and per-peer contributions (CSV)."""

    FIELDS = ["time", "peer_id", "display_name", "step", "samples", "compute_seconds", "loss"]

    def __init__(self, run_dir: Path, view=None):
        self.view = view  # a swarmview.SwarmView served at /swarm.json, or None
        self.curve = run_dir / "learning_curve.jsonl"
        self.contrib = run_dir / "contributions.csv"
        self.last_step = -1
        self.seen: dict[str, tuple[int, int]] = {}

    def record(self, step: int, num_peers: int, peers) -> None:
        now = time.time()
        if step != self.last_step:
            losses = [p.loss for p in peers if p.loss is not None]
            entry = {"time": now, "step": step, "num_peers": num_peers,
                     "samples_per_second": round(sum(p.samples_per_second for p in peers), 3),
                     "loss": round(sum(losses) / len(losses), 5) if losses else None}
            with self.curve.open("a") as f:
                f.write(json.dumps(entry) + "\n")
            self.last_step = step
            if self.view is not None:
                self.view.add_point(entry)
        if self.view is not None:
            self.view.set_status(step, sum(p.samples_per_second for p in peers), num_peers)
            for p in peers:
                self.view.add_record(p.peer_id, p.display_name, p.samples, p.compute_seconds, p.time)
        fresh = [p for p in peers if self.seen.get(p.peer_id) != (p.step, p.samples)]
        if not fresh:
            return
        new_file = not self.contrib.exists()
        with self.contrib.open("a", newline="") as f:
            writer = csv.writer(f)
            if new_file:
                writer.writerow(self.FIELDS)
            for p in fresh:
                writer.writerow([round(now, 3), p.peer_id, p.display_name, p.step, p.samples,
                                 round(p.compute_seconds, 3), p.loss])
                self.seen[p.peer_id] = (p.step, p.samples)


if __name__ == "__main__":
    sys.exit(main())
