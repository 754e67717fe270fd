"""Robust aggregation (hivemind_ext.robust_reduce, engine/robust.py) with real hivemind averagers on
loopback: a peer sending NaN never enters the average; with centered_clip an amplified peer barely
moves it, where the plain mean follows it; without the patch one NaN poisons every peer; a reducer
returning NaN averages fails the round instead of poisoning it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dedloc_core.engine import robust

ROOT = Path(__file__).resolve().parents[1]

# Four DecentralizedAverager peers in one process (each forks its own averager), one all-reduce
# round. Peer i holds a vector of HONEST[i]; the last one is the attacker ("nan" or "x1000"
# sends that; "nan-reducer" sends 1.0 and returns NaN averages).
SWARM = """
import json, sys, time
import torch, hivemind
patched, aggregation, attack = sys.argv[1] == "patched", sys.argv[2], sys.argv[3]
if patched:
    from dedloc_core.engine import hivemind_ext, robust
    hivemind_ext.install()
    robust.configure(aggregation)
honest = [1.0, 1.2, 0.8]
first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
dhts = [first] + [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                               initial_peers=[str(a) for a in first.get_visible_maddrs()]) for _ in range(3)]
# 1000 values: one peer reduces them all; 2**20: each of the four gets a share above the minimum
# (a peer offered less than one part, 2**17 values, reduces nothing)
size = 2**20 if attack == "nan-reducer" else 1000
values = [torch.full((size,), v) for v in honest]
values.append({"nan": torch.full((size,), float("nan")), "x1000": torch.full((size,), 1000.0)}.get(
    attack, torch.full((size,), 1.0)))
attacker = str(dhts[3].peer_id)  # its averager serves rpc_aggregate_part under this peer id
if attack == "nan-reducer":  # the attacker sends honest parts but returns NaN averages as a reducer
    from hivemind.averaging import allreduce
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
    streaming = allreduce.AllReduceRunner._accumulate_parts_streaming

    async def poisoned(self, stream, sender_index):
        async for message in streaming(self, stream, sender_index):
            if str(self.peer_id) == attacker:
                nan = deserialize_torch_tensor(message.tensor_part).fill_(float("nan"))
                message.tensor_part.CopyFrom(serialize_torch_tensor(nan))
            yield message

    allreduce.AllReduceRunner._accumulate_parts_streaming = poisoned
averagers = [hivemind.averaging.DecentralizedAverager([v.clone()], dht=d, prefix="robust", target_group_size=4,
                                                      min_matchmaking_time=3.0, request_timeout=1.0, start=True)
             for v, d in zip(values, dhts)]
futures = [a.step(wait=False, timeout=60, allow_retries=False) for a in averagers]
groups = []
for f in futures[:3]:  # the honest peers; the attacker's own step may wait for ever on parts nobody sends
    try:
        groups.append(len(f.result(timeout=90)))
    except Exception as exc:
        groups.append(repr(exc)[:80])
out = []
for a in averagers[:3]:
    with a.get_tensors() as tensors:
        t = tensors[0]
        out.append([float(t.min()), float(t.max()), bool(torch.isfinite(t).all())])
print(json.dumps({"honest": out, "groups": groups}))
for a in averagers:
    a.shutdown()
for d in dhts:
    d.shutdown()
"""


def swarm(mode: str, aggregation: str, attack: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SWARM, mode, aggregation, attack], cwd=ROOT, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_nan_peer_never_enters_the_average():
    seen = swarm("patched", "mean", "nan")
    for low, high, finite in seen["honest"]:
        assert finite and low == pytest.approx(1.0, abs=1e-4) and high == pytest.approx(1.0, abs=1e-4), seen


@pytest.mark.slow
def test_without_the_patch_one_nan_poisons_every_peer():
    # the bug patch 7 exists for: if hivemind ever drops non-finite parts itself, this fails
    seen = swarm("plain", "mean", "nan")
    assert all(not finite for _, _, finite in seen["honest"]), seen


@pytest.mark.slow
def test_centered_clip_holds_against_an_amplified_peer_where_the_mean_follows_it():
    clipped = swarm("patched", "centered_clip", "x1000")
    mean = swarm("patched", "mean", "x1000")
    for low, high, finite in clipped["honest"]:
        assert finite and 0.9 < low <= high < 1.6, clipped  # the honest mean is 1.0
    for low, _, _ in mean["honest"]:
        assert low > 200, mean  # (1 + 1.2 + 0.8 + 1000) / 4


@pytest.mark.slow
def test_a_reducer_returning_nan_averages_fails_the_round_instead_of_poisoning_it():
    # hivemind added whatever a reducer returned to every peer's tensors: one hostile reducer
    # poisoned the group, with mean and centered_clip alike; now that round fails for everyone
    seen = swarm("patched", "centered_clip", "nan-reducer")
    for (low, high, finite), own in zip(seen["honest"], [1.0, 1.2, 0.8], strict=True):
        assert finite and low == pytest.approx(own) and high == pytest.approx(own), seen  # local values kept
    assert all(isinstance(g, str) for g in seen["groups"][:3]), seen  # the honest peers' round failed


def test_centered_clip_math():
    honest = [torch.full((10,), v) for v in (1.0, 1.1, 0.9, 1.05)]
    robust.configure("centered_clip", radius=1.0, iterations=5)
    try:
        out = robust.centered_clip(honest + [torch.full((10,), 1e6)], [1.0] * 5)
        assert float(out.max()) < 1.2 and float(out.min()) > 0.9
        same = robust.centered_clip(honest, [1.0] * 4)  # no outlier: close to the mean
        assert float((same - 1.0125).abs().max()) < 0.05
    finally:
        robust.configure("mean")


def test_a_peer_dropped_again_and_again_is_banned_for_a_while():
    peer = "QmRepeatOffender"
    assert not robust.strike(peer, now=0.0) and not robust.strike(peer, now=1.0)
    assert robust.strike(peer, now=2.0) and robust.banned(peer, now=3.0)
    assert not robust.banned(peer, now=3.0 + robust.BAN_SECONDS)


def test_the_catalog_chooses_the_aggregation():
    import msgspec
    from conftest import tiny_experiment

    from dedloc_core.catalog import Experiment
    from dedloc_core.errors import CatalogError

    exp = msgspec.convert(tiny_experiment(aggregation="centered_clip", clip_radius=2.0, clip_iterations=5), Experiment)
    assert (exp.aggregation, exp.clip_radius, exp.clip_iterations) == ("centered_clip", 2.0, 5)
    assert msgspec.convert(tiny_experiment(), Experiment).aggregation == "mean"
    with pytest.raises((CatalogError, ValueError)):
        msgspec.convert(tiny_experiment(aggregation="median"), Experiment)


# Three peers; the victim sends each reducer its first part and answers each sender one average,
# then vanishes from the round (as a peer killed mid-round would), in its own averager only.
# hivemind took the round for a success, each peer keeping its own values for the victim's parts.
# Chunks may take up to 10 s: an honest peer slowed by a busy machine must not count as gone.
# "sender": the victim declares next to no bandwidth, so our load balancing gives it no part to
# reduce: it is only a sender, and the others average without it.
PARTIAL = """
import json, sys
import torch, hivemind
from hivemind.averaging import allreduce
if sys.argv[1] in ("patched", "sender", "rerun", "rerun-off"):
    from dedloc_core.engine import hivemind_ext
    hivemind_ext.install()
if sys.argv[1] == "rerun-off":
    from dedloc_core.engine.hivemind_ext import no_rerun
    no_rerun.grant_rerun = lambda: False
first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
dhts = [first] + [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                               initial_peers=[str(a) for a in first.get_visible_maddrs()]) for _ in range(2)]
VICTIM = dhts[2].peer_id
generate = allreduce.AllReduceRunner._generate_input_for_peer

async def vanishing(self, peer_index):
    sent = 0
    async for message in generate(self, peer_index):
        if self.peer_id == VICTIM and sent == 1:
            raise ConnectionResetError("the victim vanished")
        yield message
        sent += 1

allreduce.AllReduceRunner._generate_input_for_peer = vanishing
streaming = allreduce.AllReduceRunner._accumulate_parts_streaming

async def vanishing_reducer(self, stream, sender_index):  # it stops answering after one average
    answered = 0
    async for message in streaming(self, stream, sender_index):
        if self.peer_id == VICTIM and answered == 1:
            raise ConnectionResetError("the victim vanished")
        yield message
        answered += 1

allreduce.AllReduceRunner._accumulate_parts_streaming = vanishing_reducer
answering = allreduce.AllReduceRunner.rpc_aggregate_part

async def told_answers(self, stream, context):  # how each answer stream ended, for the log
    answered, ended = 0, "its end"
    try:
        async for message in answering(self, stream, context):
            yield message
            answered += 1
    except BaseException as exc:
        ended = repr(exc)
        raise
    finally:
        print(f"[hivemind.averaging.probe] {str(self.peer_id)[-6:]} answered {str(context.remote_id)[-6:]} "
              f"{answered} parts in {self.group_id.hex()[:8]}, ended by {ended}", file=sys.stderr, flush=True)

allreduce.AllReduceRunner.rpc_aggregate_part = told_answers
values = [torch.full((2_000_000,), float(v)) for v in (1.0, 2.0, 3.0)]
bandwidths = [100.0, 100.0, 0.01 if sys.argv[1] == "sender" else 100.0]
averagers = [hivemind.averaging.DecentralizedAverager([v.clone()], dht=d, prefix="partial", target_group_size=3,
                                                      min_matchmaking_time=3.0, request_timeout=1.0,
                                                      next_chunk_timeout=10.0, bandwidth=b, start=True)
             for v, d, b in zip(values, dhts, bandwidths)]
rerun = sys.argv[1].startswith("rerun")  # the honest peers' steps may retry, as the optimizer's do
futures = [a.step(wait=False, timeout=30, allow_retries=rerun and a is not averagers[2]) for a in averagers]
outcome, messages = [], []
for f in futures[:2]:
    try:
        outcome.append(len(f.result(timeout=90)))
    except Exception as exc:
        outcome.append(type(exc).__name__)
        messages.append(str(exc))
held = []
for a in averagers[:2]:
    with a.get_tensors() as tensors:
        held.append(sorted({round(float(x), 3) for x in tensors[0].unique()}))
print(json.dumps({"outcome": outcome, "messages": messages, "peers": [str(d.peer_id) for d in dhts],
                  "held": held}))
for a in averagers:
    a.shutdown()
for d in dhts:
    d.shutdown()
"""


def said_of_interest(line: str) -> bool:
    """The averagers' and the p2p layer's lines, and p2pd's own about connections and streams."""
    if "key_manager" in line or "identify/" in line:
        return False
    if "[hivemind.averaging." in line or "[hivemind.p2p." in line:
        return True
    return ".go:" in line and any(word in line.lower() for word in ("conn", "stream", "reset", "clos", "yamux"))


def partial(mode: str) -> dict:
    """The probe's outcome, and under "log" its averagers' own account (hivemind's debug lines)."""
    env = {**os.environ, "HIVEMIND_LOGLEVEL": "DEBUG"}
    out = subprocess.run([sys.executable, "-c", PARTIAL, mode], cwd=ROOT, capture_output=True, text=True, timeout=180,
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    said = [line[:300] for line in out.stderr.splitlines() if said_of_interest(line)]
    result["log"] = "\n".join(said[-120:])
    return result


@pytest.mark.slow
def test_a_partial_all_reduce_is_a_failed_round():
    result = partial("patched")
    assert result["outcome"] == ["MatchmakingException", "MatchmakingException"]  # both honest peers fail
    for message in result["messages"]:  # the log names the averager and the peers whose averages are missing
        assert "partial all-reduce in partial:" in message, message
        assert any(f"...{peer[-6:]}" in message for peer in result["peers"]), message


@pytest.mark.slow
def test_a_sender_gone_mid_round_is_averaged_without_and_the_round_goes_on():
    result = partial("sender")
    assert result["outcome"] == [3, 3], result  # with the victim's first parts, then without it
    assert result["held"][0] == result["held"][1] and set(result["held"][0]) <= {2.0, 1.5}, result


@pytest.mark.slow
def test_the_survivors_of_a_vanished_reducer_average_again_among_themselves():
    result = partial("rerun")  # the victim's step does not retry, as a killed peer's could not
    told = f"{result['outcome']} {result['held']} {result['messages']}\n{result['log']}"
    assert result["outcome"] == [2, 2], told
    assert result["held"] == [[1.5], [1.5]], told  # one average, not each peer's own values


@pytest.mark.slow
def test_without_the_rerun_the_survivors_each_keep_their_own_values():
    result = partial("rerun-off")
    assert result["outcome"] == ["MatchmakingException", "MatchmakingException"], result
    assert result["held"] == [[1.0], [2.0]], result


@pytest.mark.slow
def test_without_the_patch_a_partial_all_reduce_passes_for_a_success():
    assert partial("plain")["outcome"] == [3, 3]
