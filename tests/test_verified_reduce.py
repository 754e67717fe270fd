"""Verified reduction (hivemind_ext.verified_reduce, engine/reducer_check.py): four real hivemind
averagers on loopback, centered_clip; one of them reduces its slice dishonestly. Every honest peer
catches the lie in that round, keeps its own values and bans the liar; without the check the lie is
applied; an honest group is never accused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dedloc_core.engine import reducer_check as rc

ROOT = Path(__file__).resolve().parents[1]

# Peer i holds scale x (1.0 + 0.1 * noise) (seed i; scale 1 but where said), 2**20 values (each of
# the four reduces a share). The attacker (peer 3) sends honest values; as a reducer it lies:
# "source" (its robust.aggregate returns -10 x the centered clip, so its own records agree with the
# lie) or "stream" (it averages honestly, then sends back the average - 10). "verify"/"plain": the
# check on or off.
SWARM = """
import json, sys, tempfile
from pathlib import Path
import torch, hivemind
from hivemind.compression import Float16Compression
from dedloc_core.engine import bans, hivemind_ext, robust
lie, check, scale = sys.argv[1], sys.argv[2] == "verify", float(sys.argv[3])
hivemind_ext.install()
robust.configure("centered_clip", verify=check)
bans.load("verified", Path(tempfile.mkdtemp()))  # the shared ban table, before the averagers fork
size = 2**20
values = [scale * (1.0 + 0.1 * torch.randn(size, generator=torch.Generator().manual_seed(i))) for i in range(4)]
first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
dhts = [first] + [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                               initial_peers=[str(a) for a in first.get_visible_maddrs()]) for _ in range(3)]
attacker = str(dhts[3].peer_id)

def averager(i):
    return hivemind.averaging.DecentralizedAverager(
        [values[i].clone()], dht=dhts[i], prefix="verified", target_group_size=4, min_matchmaking_time=3.0,
        request_timeout=1.0, compression=Float16Compression(), start=True,
        next_chunk_timeout=10.0)  # hivemind's default (the matchmaking time) fails rounds on a loaded CI machine

averagers = [averager(i) for i in range(3)]  # the honest ones fork before the attacker's lie is set
honest_aggregate = robust.aggregate
if lie == "source":
    robust.aggregate = lambda parts, weights: -10 * honest_aggregate(parts, weights)
elif lie == "stream":
    from hivemind.averaging import allreduce
    from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
    streaming = allreduce.AllReduceRunner._accumulate_parts_streaming

    async def lying(self, stream, sender_index):
        async for message in streaming(self, stream, sender_index):
            delta = deserialize_torch_tensor(message.tensor_part)  # average - part: the peer gets average - 10
            message.tensor_part.CopyFrom(serialize_torch_tensor(delta - 10.0, message.tensor_part.compression))
            yield message

    allreduce.AllReduceRunner._accumulate_parts_streaming = lying
averagers.append(averager(3))
robust.aggregate = honest_aggregate
futures = [a.step(wait=False, timeout=60, allow_retries=False) for a in averagers]
groups = []
for f in futures[:3]:
    try:
        groups.append(len(f.result(timeout=90)))
    except Exception as exc:
        groups.append(repr(exc)[:200])
out = []
for i, a in enumerate(averagers[:3]):
    with a.get_tensors() as tensors:
        t = tensors[0]
        out.append({"unchanged": bool(torch.equal(t, values[i])), "min": float(t.min()) / scale,
                    "max": float(t.max()) / scale})
print(json.dumps({"honest": out, "groups": groups, "banned": robust.banned(attacker),
                  "bans": [b.reason for b in bans.active()]}))
for a in averagers:
    a.shutdown()
for d in dhts:
    d.shutdown()
"""


def swarm(lie: str, check: str, scale: float = 1.0) -> dict:
    out = subprocess.run([sys.executable, "-c", SWARM, lie, check, str(scale)], cwd=ROOT, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("lie", ["source", "stream"])
def test_a_lying_reducer_is_caught_in_that_round_and_banned(lie):
    seen = swarm(lie, "verify")
    assert all(isinstance(g, str) for g in seen["groups"]), seen  # the round failed for every honest peer
    assert all(peer["unchanged"] for peer in seen["honest"]), seen  # none applied the lie
    assert seen["banned"] and "returned a wrong average" in seen["bans"], seen


@pytest.mark.slow
def test_without_the_check_the_lie_is_applied():
    seen = swarm("source", "plain")
    assert seen["groups"] == [4, 4, 4], seen
    assert all(peer["min"] < -5 for peer in seen["honest"]), seen  # -10 x about 1.0 on the liar's slice
    assert not seen["banned"], seen


@pytest.mark.slow
@pytest.mark.parametrize("scale", [1.0, 1e-6])  # 1e-6: deltas below fp16's normal range, as gradients are
def test_an_honest_group_passes_the_check(scale):
    seen = swarm("none", "verify", scale)
    assert seen["groups"] == [4, 4, 4], seen
    for peer in seen["honest"]:
        assert not peer["unchanged"] and 0.5 < peer["min"] <= peer["max"] < 1.5, seen
    assert not seen["banned"] and seen["bans"] == [], seen


# ---- the judge alone ---------------------------------------------------------------------------


def _rows(parts: list[torch.Tensor], x: torch.Tensor, seed: bytes = b"s") -> dict[int, torch.Tensor]:
    return {i: rc.claim(1.0, p - x, seed, 0, 0) for i, p in enumerate(parts)}


def _centered_clip(parts: list[torch.Tensor]) -> torch.Tensor:
    from dedloc_core.engine import robust

    robust.configure("centered_clip")
    try:
        return robust.centered_clip(parts, [1.0] * len(parts))
    finally:
        robust.configure("mean")


def test_the_judge_accepts_a_true_clip_and_convicts_a_shifted_one():
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(5000, generator=gen) * 0.1 + 1.0 for _ in range(4)]
    x = _centered_clip(parts)
    claims = _rows(parts, x)
    exact = rc.Tolerance(1e-5)
    assert rc.judge(claims, claims, own=0, reducer_sender=3, radius=1.0, tol=exact, size=5000).outcome == rc.OK
    for lie in (-10 * x, x + 1.0, x + 0.2):  # the reducer's records agree with the lie; only the clip can tell
        lied = _rows(parts, lie)
        verdict = rc.judge(lied, lied, own=0, reducer_sender=3, radius=1.0, tol=exact, size=5000)
        assert verdict.outcome == rc.GUILTY, (verdict, float((lie - x).norm()))


def test_the_judge_convicts_a_reducer_whose_account_of_our_part_is_false_and_doubts_a_third_party():
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(5000, generator=gen) * 0.1 + 1.0 for _ in range(4)]
    x = _centered_clip(parts)
    truth = _rows(parts, x)
    sent_us = _rows(parts, -10 * x)  # what we (sender 0) would claim after receiving the lie
    exact = rc.Tolerance(1e-5)
    verdict = rc.judge(truth, {0: sent_us[0]}, own=0, reducer_sender=3, radius=None, tol=exact, size=5000)
    assert verdict.outcome == rc.GUILTY, verdict
    other = dict(truth)
    other[1] = rc.claim(1.0, parts[1] - x + 0.5, b"s", 0, 0)  # sender 1 says otherwise: one of the two lies
    verdict = rc.judge(truth, other, own=0, reducer_sender=3, radius=1.0, tol=exact, size=5000)
    assert verdict.outcome == rc.UNSURE, verdict


def test_compression_noise_is_not_a_lie():
    gen = torch.Generator().manual_seed(2)
    parts = [torch.randn(5000, generator=gen) * 0.1 + 1.0 for _ in range(4)]
    x = _centered_clip(parts)
    exact = _rows(parts, x)
    received = {i: rc.claim(1.0, (p - x).half().float(), b"s", 0, 0) for i, p in enumerate(parts)}  # fp16 deltas
    tol = rc.tolerance("Float16Compression")
    verdict = rc.judge(exact, received, own=0, reducer_sender=3, radius=1.0, tol=tol, size=5000)
    assert verdict.outcome == rc.OK, verdict


@pytest.mark.parametrize("outlier", [None, -0.5, 3.0])
def test_gradients_below_fp16s_normal_range_are_not_a_lie(outlier):
    # deltas of a few 1e-6 per value: fp16 keeps them only to steps of 2**-24, about 7 % here
    from hivemind.compression import CompressionInfo, Float16Compression

    codec = Float16Compression()

    def fp16(t: torch.Tensor) -> torch.Tensor:
        return codec.extract(codec.compress(t, CompressionInfo.from_tensor(t)))

    gen = torch.Generator().manual_seed(3)
    base = torch.randn(20000, generator=gen) * 1e-6
    parts = [fp16(base + torch.randn(20000, generator=gen) * 3e-7) for _ in range(4)]
    if outlier is not None:
        parts[3] = fp16(parts[3] * outlier)
    x = _centered_clip(parts)
    reducer = _rows(parts, x)
    senders = {i: rc.claim(1.0, -fp16(x - p), b"s", 0, 0) for i, p in enumerate(parts)}  # what each got back
    tol = rc.tolerance("Float16Compression")
    for own in range(3):
        verdict = rc.judge(reducer, senders, own=own, reducer_sender=3, radius=1.0, tol=tol, size=20000)
        assert verdict.outcome == rc.OK, verdict
    lied = {i: rc.claim(1.0, -fp16(-10 * x - p), b"s", 0, 0) for i, p in enumerate(parts)}  # -10 x still shows
    verdict = rc.judge(reducer, lied, own=0, reducer_sender=3, radius=1.0, tol=tol, size=20000)
    assert verdict.outcome == rc.GUILTY, verdict
