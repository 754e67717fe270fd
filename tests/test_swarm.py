"""Swarm tests: several real worker processes (real hivemind, real p2pd) training on 127.0.0.1."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from conftest import start_command, tiny_experiment
from swarmpeer import SwarmPeer, scheduling_classes, start_backbone, wait_until

from dedloc_core.catalog.model import Experiment
from dedloc_core.protocol import Pause, Resume

pytestmark = pytest.mark.slow
# the catalog's default: steps between parameter-averaging rounds
STATE_EVERY = next(f.default for f in msgspec.structs.fields(Experiment) if f.name == "average_state_every")


def join(spawn_worker, server, name, initial_peers=None, seed=0, **exp) -> SwarmPeer:
    worker = spawn_worker(name)
    worker.send(start_command(server, worker.home, initial_peers=initial_peers, seed=seed, **exp))
    peer = SwarmPeer(worker)
    wait_until([peer], lambda: any(s.state == "training" for s in peer.states), 90, "peer never started training")
    return peer


def same(a: list[float], b: list[float], rel: float = 2e-3) -> bool:
    return all(math.isclose(x, y, rel_tol=rel, abs_tol=1e-3) for x, y in zip(a, b, strict=True))


def test_three_peers_train_together(spawn_worker, corpus_server):
    first = join(spawn_worker, corpus_server, "p0", seed=1)
    others = [join(spawn_worker, corpus_server, f"p{i}", initial_peers=first.maddrs, seed=i + 1) for i in (1, 2)]
    peers = [first, *others]

    wait_until(peers, lambda: all(p.progress for p in peers), 60, "a peer reported no progress")
    start = max(p.step for p in peers)
    # Every peer must join at least two averaging rounds; hivemind rounds sometimes fail or end
    # partial on a loaded 2-core machine, so wait for that rather than for a fixed number of steps.
    wait_until(peers, lambda: min(p.step for p in peers) >= start + 6 and all(p.stats and p.stats.rounds >= 2
               for p in peers), 240, "global step did not advance by 6 with two rounds joined by every peer")

    assert max(p.progress[-1].num_peers for p in peers) >= 2
    # the training loop runs below its helper processes (limits.training_below_helpers)
    if hasattr(os, "SCHED_IDLE"):
        loop, helpers = scheduling_classes(first.worker.pid)
        assert loop == os.SCHED_IDLE
        assert helpers and os.SCHED_IDLE not in helpers, helpers
    # Peers read different data (different seeds): without gradient averaging their parameters
    # would differ at every epoch. A round that fails or ends partial (a group of two) leaves the
    # peers apart until the next parameter round brings them together, so how many epochs match
    # depends on the machine's load: CI once saw 6 of 16 (two of them before the peers first met).
    # A peer's epoch counter can trail its parameters by one after a state download (hivemind labels
    # the downloaded state with the epoch it was taken at), so compare digests across epochs.
    after = [[d for e, d in p.digests().items() if e > start] for p in peers]
    assert all(after), f"a peer reported no epoch after {start}: {[sorted(p.digests()) for p in peers]}"
    shared = [[any(same(d, o) for j in range(3) if j != i for o in after[j]) for d in after[i]] for i in range(3)]
    assert all(any(row) for row in shared), f"a peer never averaged: {after}"
    own = first.digests()
    assert not same(own[min(own)], own[max(own)]), "parameters never changed"
    # The loss falls.
    losses = [p.loss for p in first.progress if p.loss is not None]
    assert losses[-1] < losses[0] - 0.5, f"loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}"
    # Bytes were exchanged with the swarm.
    assert first.progress[-1].bytes_sent > 0 and first.progress[-1].bytes_received > 0


def test_killed_peer_does_not_stop_swarm_and_newcomer_loads_state(spawn_worker, corpus_server, monkeypatch):
    first = join(spawn_worker, corpus_server, "p0", seed=1)
    second = join(spawn_worker, corpus_server, "p1", initial_peers=first.maddrs, seed=2)
    victim = join(spawn_worker, corpus_server, "p2", initial_peers=first.maddrs, seed=3)
    peers = [first, second, victim]
    wait_until(peers, lambda: all(p.progress for p in peers), 60, "a peer reported no progress")
    start = max(p.step for p in peers)
    wait_until(peers, lambda: min(p.step for p in peers) >= start + 2, 180, "swarm did not train")

    victim.worker.kill()  # SIGKILL of its whole process group: the peer vanishes mid-run
    for peer in peers:
        peer.drain()
    step_at_kill = max(first.step, second.step)
    survivors = [first, second]
    wait_until(survivors, lambda: min(p.step for p in survivors) >= step_at_kill + 3, 180,
               "the swarm stalled after a peer was killed")

    monkeypatch.setenv("DEDLOC_TEST_LOG_LEVEL", "INFO")  # the newcomer's log says where its state came from
    # through the swarm's first peer: with volunteer_dht "client" the others would not serve the DHT
    newcomer = join(spawn_worker, corpus_server, "p3", initial_peers=first.maddrs, seed=4)
    everyone = [first, second, newcomer]
    for peer in everyone:
        peer.drain()
    joined_at = max(first.step, second.step)
    # It loaded the swarm's state while joining, before it computed a gradient: not at its first
    # step, which hivemind then throws away (before the fix it said "training" with epoch 0's state).
    said = [(s.state, s.reason) for s in newcomer.states]
    loading = next((i for i, (_, reason) in enumerate(said) if reason.startswith("Loading the swarm's state")), None)
    assert loading is not None, f"the newcomer did not load the swarm's state while joining: {said}"
    assert said[loading][0] == "joining" and loading < [s for s, _ in said].index("training"), said
    # The state it loaded was downloaded while its optimizer was being built (prefetch.py), by its
    # DHT's thread, not after: hivemind's averager downloads only once the optimizer exists.
    log = (newcomer.worker.home / "worker.log").read_text()
    # its identity was created for this join: hivemind's check that nobody uses it (a second p2pd
    # asking the swarm) is skipped; test_worker's second worker with a copied identity is still refused
    assert "Checking that identity" not in log, log[-3000:]
    loaded = re.search(r"Loaded the swarm's state in .*", log)
    assert loaded, log[-3000:]
    if "downloaded while joining" not in loaded.group(0):
        # the swarm's short steps here can outrun a slow optimizer build (4.8 s once on 2 busy cores):
        # a state two steps old is downloaded again, and only then
        stale = re.search(r"downloaded while joining is from step (\d+), the swarm is at (\d+)", log)
        assert stale and int(stale.group(2)) >= int(stale.group(1)) + 2, loaded.group(0)
    assert log.index("Downloaded the swarm's state (step") < log.index("Ready to train"), log[-3000:]
    # the parameters came in fp16, the optimizer's statistics in bfloat16 (swarm.load_state_compression)
    sizes = re.search(r"([\d.]+) MB of tensors, ([\d.]+) MB in fp32", log)
    assert sizes, f"the download's sizes are not in the log: {log[-3000:]}"
    wire, size = map(float, sizes.groups())
    assert 0 < wire < 0.55 * size, (wire, size)
    # With overlap (the catalog's default) a step's update lands one step late, and the state the
    # newcomer downloads may already hold the update its epoch label does not count yet; hivemind
    # labels a downloaded state with the epoch it was taken at: a label can trail the parameters by
    # one, so an epoch is compared with the swarm's epochs next to it (as in the test above).
    # Between two parameter-averaging steps (every ``average_state_every``-th) a failed or partial
    # gradient round leaves the peers' parameters apart, so the window spans two such steps.
    window = 2 * STATE_EVERY + 1
    wait_until(everyone, lambda: newcomer.step >= joined_at + window and len(
        {e for e in newcomer.digests() if e > joined_at} & set(first.digests())) >= window, 240,
        "the newcomer did not catch up with the swarm")
    mine, theirs = newcomer.digests(), first.digests()
    # The newcomer did not start from epoch 0: it loaded the swarm's state.
    assert min(mine) >= joined_at - 1
    epochs = sorted(e for e in mine if e > joined_at)[:window]
    near = {e: [theirs[o] for o in (e - 1, e, e + 1) if o in theirs] for e in epochs}
    assert any(same(mine[e], d) for e in epochs for d in near[e]), (
        f"newcomer's parameters differ: {[(e, mine[e][:2], [d[:2] for d in near[e]]) for e in epochs]}")


def test_a_pause_that_lands_in_an_averaging_round_is_reported_at_once(spawn_worker, corpus_server):
    # Without overlap every global step's opt.step() waits for its rounds, each at least the
    # matchmaking time (3 s); with a 32-sample target batch and a parameter round at every step too
    # (not the catalog's every 4th: with it a step can end within a second of the last one) the loop
    # spends most of its time there.
    exp = dict(overlap=False, target_batch_size=32, matchmaking_time=3.0, average_state_every=1)
    first = join(spawn_worker, corpus_server, "p0", seed=1, **exp)
    second = join(spawn_worker, corpus_server, "p1", initial_peers=first.maddrs, seed=2, **exp)
    peers = [first, second]
    wait_until(peers, lambda: min(p.step for p in peers) >= 2 and first.rounds >= 1, 120, "no averaging round")
    epoch = first.step
    wait_until(peers, lambda: first.step > epoch, 60, "no new global step")  # the loop just left a round
    time.sleep(1.0)  # 4 micro-batches later it waits in the next round
    epoch, seen = first.step, len(first.states)
    sent = time.monotonic()
    first.worker.send(Pause(reason="user"))
    wait_until(peers, lambda: any(s.state == "paused" for s in first.states[seen:]), 10, "no paused state")
    latency = time.monotonic() - sent
    assert latency < 1.0, f"pause took {latency:.3f} s"
    assert first.step == epoch, "the pause did not land in a round"
    # The round it landed in was still running: it ends after "paused", with the next global step.
    wait_until(peers, lambda: first.step > epoch, 30, "the round under the pause never ended")
    # Then it holds: 2 s paused, and the first report after resuming counts a micro-batch or a few
    # (had it trained on while paused, 2 s would have added hundreds).
    time.sleep(2.0)
    first.drain()
    held, reports, stats = first.stats.samples, len(first.progress), len(first.all_stats)
    assert [s.state for s in first.states[seen:]] == ["paused"], first.states[seen:]
    first.worker.send(Resume())
    wait_until(peers, lambda: first.states[-1].state == "training", 10, "no training state after resume")
    wait_until(peers, lambda: first.stats.samples > held, 30, "no samples after resume")
    after = [s.samples for s in first.all_stats[stats:] if s.samples > held]
    assert after[0] <= held + 5 * 8, (held, after)
    # Back, it counts itself among the peers at once (``SwarmTracker.withdraw``): its view, read while
    # it was out, had counted only the other, and it took steps alone, unaveraged (27 in 3 s).
    assert all(p.num_peers == 2 for p in first.progress[reports:]), [p.num_peers for p in first.progress[reports:]]


def test_a_paused_peer_is_not_counted_so_the_other_trains_on_alone(spawn_worker, corpus_server):
    # Two volunteers, one paused by its user. Counted still (its progress record lived on), it made
    # the other wait out each round for it: a step per averaging timeout (20 s here), and that one,
    # its step never whole, could not serve its state to the paused one once it came back.
    exp = dict(target_batch_size=32, matchmaking_time=1.0, averaging_timeout=20.0)
    first = join(spawn_worker, corpus_server, "p0", seed=1, **exp)
    second = join(spawn_worker, corpus_server, "p1", initial_peers=first.maddrs, seed=2, **exp)
    peers = [first, second]
    wait_until(peers, lambda: min(p.step for p in peers) >= 2 and second.rounds >= 1, 120, "no averaging round")
    first.worker.send(Pause(reason="user"))
    wait_until(peers, lambda: second.progress[-1].num_peers == 1, 30, "the paused peer is still counted")
    step = second.step
    time.sleep(10.0)
    second.drain()
    alone = second.step - step
    assert alone >= 4, f"alone, the other took {alone} steps in 10 s"
    first.drain()
    held = first.stats.samples
    first.worker.send(Resume())
    resumed = time.monotonic()
    wait_until(peers, lambda: second.progress[-1].num_peers == 2 and first.stats.samples > held
               and first.step >= second.step - 1, 60, "the paused peer did not come back in step")
    print(f"alone: {alone} steps in 10 s; back in step {time.monotonic() - resumed:.1f} s after resuming")


ROOT = Path(__file__).resolve().parents[1]

PRIVATE_DIRTY = """
def private_dirty_mb(pid="self"):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("Private_Dirty:")) / 1024
"""

FORK_COW = PRIVATE_DIRTY + """
import gc, multiprocessing as mp, sys
from dedloc_core.engine import swarm

def child(queue):
    before = private_dirty_mb()
    gc.collect()  # a full collection, as comes sooner or later in a DHT or averager process
    queue.put(private_dirty_mb() - before)

swarm.prepare_process()
heap = [[object() for _ in range(10)] for _ in range(100_000)]  # about 60 MB of objects the GC tracks
queue = mp.Queue()
proc = mp.Process(target=child, args=(queue,))
proc.start()
print(queue.get(timeout=60))
proc.join()
"""


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="needs os.register_at_fork")
def test_a_forked_child_collecting_garbage_does_not_copy_the_inherited_heap():
    out = subprocess.run([sys.executable, "-c", FORK_COW], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    copied = float(out.stdout.split()[-1])
    assert copied < 10, f"the child's collection copied {copied:.0f} MB of the parent's heap"


SGD_RECIPE = """
import torch

class Recipe:  # what build_optimizer needs of a recipe
    build_scheduler = None
    @staticmethod
    def build_optimizer(params):
        return torch.optim.SGD(params, lr=0.01)
"""

GRAD_COPIES = PRIVATE_DIRTY + SGD_RECIPE + """
import json, torch, hivemind
from dedloc_core.engine import swarm

swarm.prepare_process()
torch.set_num_threads(1)
model = torch.nn.Linear(2000, 2000)  # 4M parameters: 16 MB of gradients, 16 MB of accumulators
cfg = swarm.SwarmConfig(run_id="grad_copies", target_batch_size=10**9, batch_size_per_step=4,
                        overlap=True)
dht = swarm.start_dht(cfg)
opt = swarm.build_optimizer(dht, cfg, model, Recipe)
before = private_dirty_mb(opt.grad_averager.pid)
for _ in range(5):  # micro-batches: the worker rewrites its gradients and accumulators
    model(torch.randn(4, 2000)).square().mean().backward()
    opt.step()
    opt.zero_grad()
grown = private_dirty_mb(opt.grad_averager.pid) - before
shared = all(p.grad is not None and p.grad.is_shared() for p in model.parameters())
opt.shutdown()
dht.shutdown()
print(json.dumps(dict(grown=grown, shared=shared)))
"""


def test_the_gradient_averager_keeps_no_copy_of_the_gradients_the_worker_rewrites():
    """The parameters' gradients and hivemind's accumulators exist before the gradient averager's
    process forks; as private pages, every micro-batch of the worker left that process an old copy
    (32 MB here). In shared memory they stay one copy, and zero_grad keeps them there."""
    out = subprocess.run([sys.executable, "-c", GRAD_COPIES], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["grown"] < 8, f"the gradient averager's process gained {got['grown']:.0f} MB of private memory"
    assert got["shared"], got


ROUND_TIMING = SGD_RECIPE + """
import dataclasses, json, math, torch
from hivemind.utils import get_dht_time
from dedloc_core.engine import swarm

swarm.prepare_process()
model = torch.nn.Linear(8, 8)
cfg = swarm.SwarmConfig(run_id="round_timing", target_batch_size=10**9, batch_size_per_step=4,
                        overlap=True, matchmaking_time=1.0, averaging_timeout=7.0)
dht = swarm.start_dht(cfg)
opt = swarm.build_optimizer(dht, cfg, model, Recipe)
began = get_dht_time()
unscheduled = opt.grad_averager.schedule_step()  # what hivemind does at a step's end with no group scheduled
deadline_in = unscheduled.deadline - began
unscheduled.cancel()

running = opt.grad_averager.schedule_step(timeout=30.0)
running.allow_allreduce()  # the last step's round, triggered and still looking for a group
opt.scheduled_grads = running
progress = opt.tracker.global_progress
opt.tracker.global_progress = dataclasses.replace(progress, eta_next_epoch=get_dht_time())  # the step ends now
opt._maybe_schedule_gradient_averaging()
kept_while_running = opt.scheduled_grads is running
running.cancel()
opt.scheduled_grads = None
opt.tracker.global_progress = dataclasses.replace(progress, eta_next_epoch=get_dht_time())
opt._maybe_schedule_gradient_averaging()
scheduled, opt.scheduled_grads = opt.scheduled_grads, None  # shutdown would cancel it a second time
scheduled_after = scheduled is not None
if scheduled_after:
    scheduled.cancel()

# the last round ran on until this step's end (finished while the step waited for its update):
# this step still begins a round of its own
opt.scheduled_grads = running
opt.tracker.global_progress = dataclasses.replace(progress, num_peers=2)
began_own = opt._begin_averaging_gradients(None) and opt.scheduled_grads not in (None, running)
if opt.scheduled_grads is not None:
    opt.scheduled_grads.cancel()
opt.scheduled_grads = None
opt.shutdown()
dht.shutdown()
print(json.dumps(dict(deadline_in=deadline_in if math.isfinite(deadline_in) else None,
                      kept_while_running=kept_while_running, scheduled_after=scheduled_after,
                      began_own=bool(began_own))))
"""


def test_gradient_rounds_have_a_deadline_and_none_is_scheduled_while_the_last_one_runs():
    """A round begun at a step's end without a pre-scheduled group ends within the averaging timeout
    (hivemind gives it none: it retried until a group formed, holding the next rounds back), and no
    round is scheduled while the last step's round still runs (it grouped with peers that then sent
    their parts to this one before it could take them), yet a step whose end that round outlasted
    begins a round of its own (hivemind began none: a 2-peer swarm with short steps averaged once
    in 57 steps)."""
    out = subprocess.run([sys.executable, "-c", ROUND_TIMING], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["deadline_in"] is not None and 6.0 < got["deadline_in"] <= 7.5, got
    assert got["kept_while_running"], got
    assert got["scheduled_after"], got
    assert got["began_own"], got


STATE_WIRE = """
import json, torch
from hivemind.compression import CompressionInfo, TensorRole, deserialize_torch_tensor
from hivemind.optim.state_averager import dump_optimizer_state, load_optimizer_state
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming
from dedloc_core.engine import swarm

def adam(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)

torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
opt = adam(model)
for scale in (1.0, 1e-7, 1e-7):  # gradients of 1e-7: Adam's second moment down to ~1e-17
    model.zero_grad()
    (scale * model(torch.randn(8, 64)).square().mean()).backward()
    opt.step()
metadata, tensors = dump_optimizer_state(opt)
compression = swarm.load_state_compression()
wire, received = 0, []
for i, tensor in enumerate(tensors):  # the server's side of rpc_download_state, then the newcomer's
    info = CompressionInfo.from_tensor(tensor, key=i, role=TensorRole.OPTIMIZER)
    parts = list(split_for_streaming(compression.compress(tensor, info, allow_inplace=False), 4096))
    wire += sum(len(p.buffer) for p in parts)
    received.append(deserialize_torch_tensor(combine_from_streaming(parts)))
other = torch.nn.Linear(64, 64)
fresh = adam(other)
other(torch.randn(1, 64)).sum().backward()
fresh.step()  # its state exists, as hivemind's averager makes it before loading
load_optimizer_state(fresh, metadata, received)
sent, got = opt.state_dict()["state"], fresh.state_dict()["state"]
errors, zeros, steps = [], 0, []
for key in sent:
    steps.append([float(sent[key]["step"]), float(got[key]["step"]), str(got[key]["step"].dtype)])
    for name in ("exp_avg", "exp_avg_sq"):
        a, b = sent[key][name], got[key][name]
        assert b.dtype == torch.float32, b.dtype
        nonzero = a != 0
        zeros += int((b[nonzero] == 0).sum())
        errors.append(float(((b - a).abs()[nonzero] / a.abs()[nonzero]).max()))
smallest = min(float(sent[k]["exp_avg_sq"][sent[k]["exp_avg_sq"] > 0].min()) for k in sent)
print(json.dumps(dict(wire=wire, memory=sum(t.numel() * t.element_size() for t in tensors), error=max(errors),
                      zeros=zeros, steps=steps, smallest=smallest)))
"""


def test_a_newcomer_gets_the_optimizer_statistics_in_half_the_bytes_and_their_range():
    """A newcomer's download (swarm.load_state_compression) sends Adam's statistics in bfloat16: half
    the bytes of fp32, fp32's range (a second moment of 1e-17 is not rounded to zero as fp16 would),
    about 3 significant digits; the step count exactly. Decoded by hivemind's own deserializer and
    loaded by torch.optim as fp32."""
    out = subprocess.run([sys.executable, "-c", STATE_WIRE], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["smallest"] < 1e-12, got  # the probe reaches the range fp16 loses (its smallest: 6e-8)
    assert got["zeros"] == 0, got
    assert got["error"] <= 2 ** -8, got
    assert all(s == r and dtype == "torch.float32" for s, r, dtype in got["steps"]), got["steps"]
    assert got["wire"] < 0.55 * got["memory"], got


async def _ping(peer_id: str, _dht, node):
    from hivemind.p2p import PeerID

    return await node.protocol.call_ping(PeerID.from_base58(peer_id))


def _answers_dht_ping(dht, peer_id: str) -> bool:
    return dht.run_coroutine(functools.partial(_ping, peer_id)) is not None


def test_volunteers_that_use_the_dht_without_serving_it_average_and_serve_it_when_the_backbone_is_gone(
        spawn_worker, corpus_server, tmp_path):
    """``volunteer_dht="client"``: volunteers that join through a backbone use the DHT without serving
    it (they answer no DHT request; the backbone does), yet their averagers take connections, so they
    average with each other: the backbone joins no gradient round, and hivemind's Optimizer would have
    made their averagers clients too, leaving no peer to reduce (hivemind_ext.optimizer_client_mode). When the
    backbone dies they start serving the DHT and introduce themselves to the peers they are connected
    to (``dht_fallback``), and go on averaging: without that, nobody answered their DHT requests, no
    group formed, and each took local steps alone."""
    import hivemind

    exp = tiny_experiment(volunteer_dht="client")
    backbone, ready, _ = start_backbone(exp, tmp_path)
    probe = None
    try:
        peers = [join(spawn_worker, corpus_server, f"p{i}", initial_peers=ready["maddrs"], seed=i + 1,
                      volunteer_dht="client") for i in (1, 2)]
        wait_until(peers, lambda: all(p.stats and p.stats.rounds >= 2 for p in peers), 180,
                   "both volunteers should join two averaging rounds")
        ids = [p.maddrs[0].rsplit("/p2p/", 1)[1] for p in peers]
        # the probe's p2pd knows the volunteers' addresses; its DHT knows only the backbone
        probe = hivemind.DHT(initial_peers=ready["maddrs"] + [p.maddrs[0] for p in peers],
                             host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True, start=True)
        assert _answers_dht_ping(probe, ready["maddrs"][0].rsplit("/p2p/", 1)[1]), "the backbone should serve"
        for p, i in zip(peers, ids, strict=True):
            assert not _answers_dht_ping(probe, i), f"{p.describe()} served while the backbone was up"
        backbone.kill()
        before = [p.rounds for p in peers]
        wait_until(peers, lambda: all(p.rounds >= r + 3 for p, r in zip(peers, before, strict=True)), 240,
                   f"the volunteers should average without the backbone (rounds when it died: {before})")
        assert all(_answers_dht_ping(probe, i) for i in ids), "a volunteer does not serve the DHT"
    finally:
        if probe is not None:
            probe.shutdown()
        backbone.stop(timeout=30)
