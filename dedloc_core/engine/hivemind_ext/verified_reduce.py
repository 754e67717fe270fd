"""Verified reduction: a reducer's average is checked by every peer before it applies it.

Upstream: ``hivemind/averaging/allreduce.py``: ``AllReduceRunner.run`` (wrapped, over
``partial_rounds``); ``hivemind/averaging/averager.py``: ``DecentralizedAverager`` gains the RPC
``rpc_verify_round`` (hivemind registers every ``rpc_*`` method of the class as a handler).

Without it: in hivemind's all-reduce each peer reduces one slice for the whole group, and a reducer
that returns a finite but wrong average (say -10 times the true one) has it applied by every peer;
nothing notices. Centered clip does not help, since the clipping happens inside the liar.

Fix: with ``robust.verifying()`` (``centered_clip`` aggregation), ``run`` holds the group's averages
back until it has checked them: it draws a fresh random seed, asks every group member that accepts
calls (``rpc_verify_round``) for its claims under that seed (``engine/reducer_check.py``), and judges
every part of every other reducer. A reducer caught lying is banned (``robust.ban``: every
averager of the worker, kept across restarts, reported in invite-only experiments) and the round
fails: no peer that checked applies the lie (hivemind's optimizer goes on with local gradients).
A part that cannot be settled (a reducer and a sender disagree, a reducer does not answer) fails
the round without a ban. Each peer keeps what it needs to answer (its received averages, and as a
reducer every part it averaged) for ``KEEP_SECONDS``.

Cost per round and verifying peer: one request to each other member, answered with
``reducer_check.ROW`` float64 values per part sent and per part averaged per sender; a sketch of
every value it sent and averaged (``bench/verify_cost.py`` measures both).

Kind: our policy

Shown: ``tests/test_verified_reduce.py`` (slow: a reducer returning -10 times its centered clip is
caught in that round by every honest peer, which keeps its own values and bans it; without it the
lie is applied; an honest group is never accused, also under fp16).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref

import torch

REPLACES = ["hivemind.averaging.allreduce.AllReduceRunner.run"]

KEEP_SECONDS = 60.0  # how long a peer keeps a round's data to answer the group's checks
KEEP_ROUNDS = 4  # and at most this many rounds (each holds about two copies of the averaged tensors)
TIMEOUT = 15.0  # how long a peer waits for the group's claims (and a member for its own round to end)
log = logging.getLogger(__name__)
_rounds: dict[bytes, _Round] = {}  # group id -> this process's record of that round
_kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # reducer -> {part: (senders, parts, weights, x)}


class _Round:
    """What one peer knows of one all-reduce: who sent what, its received averages, its reductions."""

    def __init__(self, runner) -> None:
        container = runner.tensor_part_container
        self.runner, self.created, self.done, self.ok = runner, time.monotonic(), asyncio.Event(), False
        self.lengths = [[part.numel() for part, _ in parts] for parts in container._input_parts_by_peer]
        codec = getattr(container.compression, "codec", container.compression)  # inside delta_averaging.ErrorFeedback
        self.compression = type(codec).__name__
        self.received: dict[tuple[int, int], torch.Tensor] = {}
        self.asked_by: set = set()
        self.kept = _kept.setdefault(runner.tensor_part_reducer, {})

    def finish(self, deltas: list[torch.Tensor] | None) -> None:
        if deltas:
            flat = torch.cat([d.reshape(-1).float() for d in deltas])
            pieces = flat.split([n for parts in self.lengths for n in parts])
            keys = [(r, k) for r, parts in enumerate(self.lengths) for k in range(len(parts))]
            self.received = dict(zip(keys, pieces, strict=True))
        self.ok = deltas is not None
        self.done.set()

    def claims(self, seed: bytes, as_reducer: bool = True) -> torch.Tensor:
        from dedloc_core.engine import reducer_check as rc

        runner = self.runner
        me = runner.ordered_peer_ids.index(runner.peer_id)
        sender = runner.peer_id in runner.sender_peer_ids
        return rc.claim_rows(seed, me, runner.weight, self.received if sender else None, self.kept,
                             len(runner.sender_peer_ids), len(self.lengths[me]) if as_reducer else 0)


def _keep_part(reducer, part_index: int, senders, parts, weights, result) -> None:
    from dedloc_core.engine import robust

    if robust.verifying():
        _kept.setdefault(reducer, {})[part_index] = (senders, parts, weights, result.detach().clone())


def _expire() -> None:
    """Forget rounds every member has asked about, older than ``KEEP_SECONDS``, or beyond ``KEEP_ROUNDS``."""
    now = time.monotonic()
    for group_id, rnd in list(_rounds.items()):
        if now - rnd.created > KEEP_SECONDS or len(rnd.asked_by) >= len(rnd.runner.ordered_peer_ids) - 1:
            _rounds.pop(group_id, None)
    while len(_rounds) >= KEEP_ROUNDS:
        _rounds.pop(next(iter(_rounds)))


async def _verify(runner, rnd: _Round) -> None:
    """Judge every part of every other reducer; raise (after banning a liar) unless all are fine."""
    from hivemind.averaging.averager import AveragingMode
    from hivemind.averaging.partition import AllreduceException
    from hivemind.compression import deserialize_torch_tensor
    from hivemind.proto import averaging_pb2

    from dedloc_core.engine import reducer_check as rc
    from dedloc_core.engine import robust

    seed, peers = os.urandom(32), runner.ordered_peer_ids
    asked = [p for p, mode in zip(peers, runner.modes, strict=True)
             if p != runner.peer_id and mode != AveragingMode.CLIENT]  # a client peer takes no calls

    async def ask(peer):
        request = averaging_pb2.AveragingData(group_id=runner.group_id, peer_id=seed)
        reply = await runner._get_peer_stub(peer).rpc_verify_round(request, timeout=TIMEOUT)
        if reply.code != averaging_pb2.AVERAGED_PART:
            raise AllreduceException(averaging_pb2.MessageCode.Name(reply.code))
        return deserialize_torch_tensor(reply.tensor_part)

    began = time.perf_counter()
    replies = await asyncio.gather(*(ask(p) for p in asked), return_exceptions=True)
    answers = dict(zip(asked, replies, strict=True))
    answers[runner.peer_id] = await asyncio.get_running_loop().run_in_executor(None, rnd.claims, seed, False)
    radius = robust.radius() if robust.kind() == "centered_clip" else None
    verdicts = rc.judge_round(peers, runner.peer_id, runner.sender_peer_ids, rnd.lengths, answers, radius,
                              rc.tolerance(rnd.compression))
    for reducer, verdict in verdicts:
        if verdict.outcome == rc.GUILTY:
            robust.ban(str(reducer), "returned a wrong average")
            raise AllreduceException(f"reducer ...{str(reducer)[-6:]} {verdict.reason}: the round is not applied")
    if verdicts:
        doubts = "; ".join(f"...{str(reducer)[-6:]}: {verdict.reason}" for reducer, verdict in verdicts)
        raise AllreduceException(f"could not verify the group's averages ({doubts}): the round fails")
    size = sum(a.numel() * 8 for p, a in answers.items() if p != runner.peer_id and isinstance(a, torch.Tensor))
    log.debug("Verified %d reducers in %.0f ms (%d bytes of claims)", len(asked),
              1000 * (time.perf_counter() - began), size)


def install() -> None:
    import functools

    from hivemind.averaging import allreduce, averager, partition
    from hivemind.compression import serialize_torch_tensor
    from hivemind.p2p import P2PContext
    from hivemind.proto import averaging_pb2

    from dedloc_core.engine import robust

    partition.TensorPartReducer.keep_part = _keep_part  # robust_reduce calls it for each finished part
    run = allreduce.AllReduceRunner.run

    @functools.wraps(run)
    async def run_verified(self):
        if not robust.verifying():
            async for delta in run(self):
                yield delta
            return
        _expire()
        rnd = _rounds[self.group_id] = _Round(self)
        try:
            deltas = [delta async for delta in run(self)]  # held back until checked
        except BaseException:
            rnd.finish(None)
            raise
        rnd.finish(deltas)
        if deltas:
            await _verify(self, rnd)
        for delta in deltas:
            yield delta

    allreduce.AllReduceRunner.run = run_verified

    async def rpc_verify_round(self, request: averaging_pb2.AveragingData,
                               context: P2PContext) -> averaging_pb2.AveragingData:
        rnd = _rounds.get(request.group_id)
        if rnd is None or context.remote_id not in rnd.runner.ordered_peer_ids:
            return averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
        try:
            await asyncio.wait_for(rnd.done.wait(), TIMEOUT)
        except TimeoutError:
            return averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
        if not rnd.ok:
            return averaging_pb2.AveragingData(code=averaging_pb2.INTERNAL_ERROR)
        rows = await asyncio.get_running_loop().run_in_executor(None, rnd.claims, bytes(request.peer_id))
        rnd.asked_by.add(context.remote_id)
        return averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialize_torch_tensor(rows))

    # hivemind builds the handler from these (resolved here: this module's annotations are strings)
    rpc_verify_round.__annotations__ = {"request": averaging_pb2.AveragingData, "context": P2PContext,
                                        "return": averaging_pb2.AveragingData}
    averager.DecentralizedAverager.rpc_verify_round = rpc_verify_round
    classes = [averager.DecentralizedAverager]
    for cls in classes:  # and every subclass: one collected before would lack the new RPC
        classes += cls.__subclasses__()
        if cls.__dict__.get("_rpc_handlers") is not None:
            cls._rpc_handlers = cls._stub_type = None
