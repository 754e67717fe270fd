"""The backbone's engine half: it follows the swarm's training state, serves it to newcomers and
writes checkpoints (``dedloc_core.organizer.backbone`` runs it once its HTTP side is up).

``keep`` runs until ``stop`` is set; ``SyncKeeper`` follows a synchronous swarm, ``DilocoKeeper`` a
DiLoCo swarm's outer model; ``Checkpoint`` writes the model and optimizer state atomically. In an
invite-only swarm the keeper also holds the backbone's own token (``_OwnToken``), publishes the
organizer's signed revocation list (``_RevocationList``) and relays for members only (``member_relay``).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from . import bans, gate, member_relay, metrics, pacing, progress_digest, robust, swarm
from .diloco import DilocoOptimizer
from .evaluation import Evaluator
from .reachability import serve_dialback
from .recipes import load_recipe
from .training import kill_children

logger = logging.getLogger(__name__)

RECORD_PERIOD = 5.0  # seconds between reads of the peers' metrics


def keep(exp, args, run_dir: Path, http_url: str | None, *, stop: threading.Event, recorder,
         write_ready: Callable[[dict], None], issuer=None) -> None:
    """Join the swarm of ``exp`` as its keeper (``args``: the backbone's options) until ``stop``."""
    swarm.prepare_process()
    robust.configure(exp.aggregation, exp.clip_radius, exp.clip_iterations)
    bans.load(exp.run_id, run_dir / "bans")  # one ban list for its averagers, kept in its run dir
    recipe = load_recipe(exp.recipe, exp.recipe_params)
    model = recipe.build_model(seed=0)
    cfg = swarm.config_for(
        exp, role="backbone",
        initial_peers=args.initial_peer,
        host_maddrs=args.listen or ["/ip4/127.0.0.1/tcp/0"],
        announce_maddrs=args.announce,
        identity_path=str(run_dir / "identity.key"),
        # an invite-only swarm's relay is ours, for members only (member_relay); p2pd's serves anyone
        relay_service=not args.no_relay and issuer is None,
    )
    own_token = None
    if issuer is not None:  # invite-only: the backbone is the issuer and holds a token of its own
        identity = metrics.load_identity_key(cfg.identity_path)
        with open(cfg.identity_path, "rb") as f:
            peer_id = PeerID.from_identity(f.read()).to_base58()
        gate.configure(exp.run_id, exp.invite_key)
        holder = gate.TokenHolder(issuer.token_for(peer_id, "backbone"))
        cfg.authorizer = gate.InviteAuthorizer(identity, holder)
    dht = swarm.start_dht(cfg)
    if issuer is not None and not args.no_relay:
        member_relay.serve(dht)
    serve_dialback(dht)  # volunteers ask us whether we can reach them
    progress_digest.serve(dht, exp.run_id)  # and read the swarm's progress from us
    subkey = metrics.add_validators(dht, exp.run_id)
    revocations = None
    if issuer is not None:
        own_token = _OwnToken(issuer, peer_id, holder, lambda token: gate.publish(dht, token, subkey=subkey))
        revocations = _RevocationList(issuer, dht, subkey)
        revocations.publish_if_due()
    keeper = _keeper(exp, args, dht, cfg, model, recipe)
    opt = keeper.opt
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    checkpoint = Checkpoint(run_dir / "checkpoint.pt")
    checkpoint.restore(model, keeper)
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    write_ready({"peer_id": str(dht.peer_id), "maddrs": maddrs, "http_url": http_url,
                 "run_id": exp.run_id, "pid": os.getpid(), "epoch": opt.local_epoch, "mode": exp.mode})
    logger.info("Backbone up (%s mode): %s", exp.mode, " ".join(maddrs))
    last_saved = opt.local_epoch
    next_record = 0.0
    evaluator = Evaluator(exp, recipe, model, every=args.eval_every, batches=args.eval_batches,
                          data_dir=args.data_dir, base_url=http_url, cache=run_dir / "eval-cache")
    try:
        while not stop.wait(args.poll):
            if own_token is not None:
                own_token.renew_if_due()
            if revocations is not None:
                revocations.publish_if_due()
            if keeper.catch_up():
                logger.info("Caught up with global step %d", opt.local_epoch)
            if opt.local_epoch >= last_saved + args.checkpoint_every:
                checkpoint.save(model, keeper)
                last_saved = opt.local_epoch
            if evaluator.due(opt.local_epoch):  # the step of the state the model holds
                loss = evaluator.run(opt.local_epoch)
                if loss is not None:
                    recorder.record_eval(opt.local_epoch, loss)
            if time.monotonic() >= next_record:
                recorder.record(keeper.step(), keeper.num_peers(), metrics.fetch(dht, exp.run_id))
                next_record = time.monotonic() + RECORD_PERIOD
    finally:
        if opt.local_epoch > last_saved:
            checkpoint.save(model, keeper)
        opt.shutdown()
        dht.shutdown()
        kill_children()


class _OwnToken:
    """The backbone's own token, re-issued at half life and published like a volunteer's."""

    def __init__(self, issuer, peer_id: str, holder, publish):
        self.issuer, self.peer_id, self.holder, self.publish = issuer, peer_id, holder, publish
        self.due = time.monotonic() + issuer.lifetime / 2
        publish(holder.get())

    def renew_if_due(self) -> None:
        if time.monotonic() >= self.due:
            token = self.issuer.token_for(self.peer_id, "backbone")
            self.holder.set(token)
            self.publish(token)
            self.due = time.monotonic() + self.issuer.lifetime / 2


class _RevocationList:
    """The peers the organizer revoked within the last token lifetime (whose tokens may still be
    valid), signed with the issuer key and stored in the DHT every ``gate.REVOKED_PUBLISH_S`` and
    as soon as ``dedloc invite revoke`` (another process) adds one to ``invites.db``."""

    MARGIN = 60.0  # seconds a peer stays listed after its last token can have expired (clock skew)

    def __init__(self, issuer, dht, subkey):
        self.issuer, self.dht, self.subkey = issuer, dht, subkey
        self.peers: frozenset[str] | None = None
        self.due = 0.0

    def publish_if_due(self) -> None:
        since = time.time() - self.issuer.lifetime - self.MARGIN
        peers = frozenset(peer for peer, _ in self.issuer.store.revoked_peers(since))
        if peers == self.peers and time.monotonic() < self.due:
            return
        gate.publish_revocations(self.dht, self.issuer.key, peers, self.subkey)
        if peers != self.peers:
            logger.info("Revocation list published: %d revoked peer(s)", len(peers))
        self.peers, self.due = peers, time.monotonic() + gate.REVOKED_PUBLISH_S


class Checkpoint:
    """The model, optimizer state and epoch, written atomically."""

    def __init__(self, path: Path):
        self.path = path

    def save(self, model, keeper) -> None:
        buf = tempfile.NamedTemporaryFile(dir=self.path.parent, prefix=".ckpt.", delete=False)
        try:
            with buf:
                torch.save({"model": model.state_dict(), "optimizer": keeper.opt.state_dict(),
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
            state = torch.load(self.path, map_location="cpu", weights_only=True)
            if state.get("mode", "sync") != keeper.mode:
                raise ValueError(f"it was written in {state.get('mode', 'sync')} mode")
            model.load_state_dict(state["model"])
            keeper.opt.load_state_dict(state["optimizer"])
        except Exception as exc:  # a bad checkpoint must not stop the node
            logger.error("Ignoring unreadable checkpoint %s: %s", self.path, exc)
            return
        keeper.restored(state["epoch"])
        logger.info("Restored checkpoint at global step %d", state["epoch"])


def _keeper(exp, args, dht, cfg, model, recipe):
    if exp.mode == "diloco":
        return DilocoKeeper(exp, dht, cfg, model, recipe)
    return SyncKeeper(dht, cfg, model, recipe, follow_every=getattr(args, "follow_every", 0.0))


class SyncKeeper:
    """Follows a synchronous (DeDLOC) swarm with a hivemind.Optimizer that never steps."""

    mode = "sync"

    def __init__(self, dht, cfg, model, recipe, follow_every: float = 0.0):
        self.opt = swarm.build_optimizer(dht, cfg, model, recipe)
        self.follow_every, self._loaded = follow_every, -float("inf")
        self._due_since: float | None = None

    def catch_up(self) -> bool:
        """Load the swarm's state when it is ahead, at most every ``follow_every`` seconds: each load
        is the whole state, uploaded by a volunteer. The load waits for the quiet part of a step
        (``pacing.quiet``), at most ``QUIET_WAIT`` steps: a volunteer uploading its state during a
        round slowed the round on its link until it failed (the network lab: a parameter round's
        reducer got 2.4 % of its inputs in time while the 20 Mbit/s volunteer uploaded to us)."""
        now = time.monotonic()
        if self.opt.tracker.global_epoch <= self.opt.local_epoch or now - self._loaded < self.follow_every:
            self._due_since = None
            return False
        if self._due_since is None:
            self._due_since = now
        step = self._step_seconds()
        longest_wait = self.QUIET_WAIT * (step if math.isfinite(step) else self.UNKNOWN_STEP)
        left = self.opt.tracker.global_progress.eta_next_epoch - get_dht_time()
        if now - self._due_since < longest_wait and not pacing.quiet(left, step):
            return False
        self.opt.load_state_from_peers()
        self._loaded, self._due_since = time.monotonic(), None
        return True

    QUIET_WAIT = 2.0  # steps to wait for a quiet moment before loading anyway
    UNKNOWN_STEP = 10.0  # seconds a step is taken to last while no peer reports its samples/s

    def _step_seconds(self) -> float:
        """The swarm's step length from its peers' reports: target batch / their samples per second."""
        sps = self.opt.tracker.swarm_samples_per_second  # a swarm.SwarmTracker (swarm.build_optimizer)
        return self.opt.tracker.target_batch_size / sps if sps > 0 else math.inf

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
