"""Robust aggregation: a reducer drops non-finite parts, may clip, and banned peers are shunned.

Upstream: ``hivemind/averaging/partition.py``: ``TensorPartReducer.accumulate_part`` and
``check_current_part_finished`` (replaced whole), ``reset_accumulators`` and ``on_sender_failed``
(wrapped), ``TensorPartContainer.register_processed_part`` (wrapped);
``hivemind/averaging/allreduce.py``: ``AllReduceRunner.__init__`` (wrapped: peer names for the log);
``hivemind/averaging/matchmaking.py``: ``Matchmaking._check_reasons_to_reject`` and
``_request_join_group`` (wrapped); ``hivemind/averaging/averager.py``:
``DecentralizedAverager.rpc_download_state`` (wrapped) and ``get_stub`` (``ServicerBase``'s, wrapped
for averagers: a banned peer's stub answers ``rpc_download_state`` with nothing, which
``_load_state_from_peers`` takes as "no state there, try the next peer").

Without it: ``TensorPartReducer`` adds every sender's part to a weighted mean, NaN and all: one
broken or hostile peer poisons every peer's step. A reducer's NaN or inf average is added to every
peer's tensors. A peer caught by one averager goes on averaging with the others and serving its
state. Every sender's handler awaits a part's one future: a handler cancelled as its sender left
cancels it for all, and the reducer's own step waits for ever, holding its tensors.

Fix: ``accumulate_part`` awaits the part's future shielded, and drops a non-finite part (that sender
leaves this round, named in the log, with a strike, see ``engine/robust.py``) and, with
``robust.configure("centered_clip")``, keeps the parts and returns their centered clip instead of
the mean. An average with NaN or inf that a reducer returns is not used: that reducer's parts count
as failed (the round fails, ``partial_rounds``) and it gets a strike. ``on_sender_failed`` is
idempotent (a dropped sender is banned by the runner too). A peer that ``robust.banned`` (one
dropped again and again, or caught lying, in any of this worker's averagers: ``engine/bans.py``) is
neither accepted nor followed by ``Matchmaking``, its state is never downloaded and it gets none of
ours. A part whose sender left is averaged without it, as hivemind does (``partial_rounds``).

Kind: our policy; bug fixes (docs/hivemind/robust_reduce.patch): the shield, the idempotent
``on_sender_failed``, the refused NaN average.

Shown: (slow) ``tests/test_robust.py`` (one NaN peer poisons all without it; centered clip holds
against an amplified peer; a NaN reducer fails the round), ``tests/test_shared_average.py`` (a
sender leaves waiting), ``tests/test_bans.py`` (one averager's ban holds in the other's).
"""

from __future__ import annotations

import asyncio
import functools
import logging

REPLACES = [
    "hivemind.averaging.partition.TensorPartReducer.accumulate_part",
    "hivemind.averaging.partition.TensorPartReducer.check_current_part_finished",
    "hivemind.averaging.partition.TensorPartReducer.reset_accumulators",
    "hivemind.averaging.partition.TensorPartReducer.on_sender_failed",
    "hivemind.averaging.partition.TensorPartContainer.register_processed_part",
    "hivemind.averaging.allreduce.AllReduceRunner.__init__",
    "hivemind.averaging.matchmaking.Matchmaking._check_reasons_to_reject",
    "hivemind.averaging.matchmaking.Matchmaking._request_join_group",
    "hivemind.averaging.averager.DecentralizedAverager.rpc_download_state",
    "hivemind.averaging.averager.DecentralizedAverager._load_state_from_peers",
    "hivemind.p2p.servicer.ServicerBase.get_stub",
]

log = logging.getLogger(__name__)


def install() -> None:
    from hivemind.averaging import allreduce, averager, matchmaking, partition
    from hivemind.proto import averaging_pb2

    from dedloc_core.engine import robust

    reducer = partition.TensorPartReducer
    original_reset, original_failed = reducer.reset_accumulators, reducer.on_sender_failed

    def reset_accumulators(self) -> None:
        self.robust_parts = []  # (sender, part, weight) of the current part: aggregated once all are in
        if not hasattr(self, "dropped"):
            self.dropped = set()  # senders left out for what they sent (NaN)
            self.gone = set()  # senders left out since they left the round (logged once)
        original_reset(self)

    def on_sender_failed(self, sender_index: int) -> None:
        if self.sender_failed_after[sender_index] == float("inf"):
            original_failed(self, sender_index)

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part, weight: float = 1.0):
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            await asyncio.wait({self.current_part_future, asyncio.create_task(self.finished.wait())},
                               return_when=asyncio.FIRST_COMPLETED)
            if self.finished.is_set():
                raise partition.AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise partition.BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            if not robust.finite(tensor_part):
                self.num_parts_received[sender_index] -= 1  # not counted: the sender fails before this part
                names = getattr(self, "sender_names", None)
                peer = names[sender_index] if names else f"sender {sender_index}"
                log.warning("Dropped part %d from %s: it holds NaN or inf; it leaves this round", part_index, peer)
                robust.strike(peer, "sent NaN or inf")
                self.dropped.add(sender_index)
                self.on_sender_failed(sender_index)
                raise partition.BannedException(f"{peer} sent a non-finite part")
            self.robust_parts.append((sender_index, tensor_part.detach().clone(), float(weight)))
            self.current_part_accumulated_from += 1
            self.denominator += weight
            self.check_current_part_finished()
        return await asyncio.shield(current_part_future)  # shared: a leaving sender must not cancel it

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders:
            if not self.robust_parts:  # every sender's part was dropped or lost
                self.current_part_future.set_exception(partition.AllreduceException(
                    "no sender's part reached this reducer: nothing to average"))
                self.current_part_future.exception()  # retrieved: no "never retrieved" warning
            else:
                # a sender gone from the round is left out: every peer still gets the same average
                gone = [i for i, after in enumerate(self.sender_failed_after)
                        if after <= self.current_part_index and i not in self.dropped and i not in self.gone]
                if gone:
                    self.gone.update(gone)
                    names = getattr(self, "sender_names", None)
                    log.info("Averaging part %d and on without %s: gone from the round", self.current_part_index,
                             ", ".join(f"...{names[i][-6:]}" if names else str(i) for i in gone))
                senders, parts, weights = zip(*self.robust_parts, strict=True)
                result = robust.aggregate(list(parts), list(weights))
                keep = getattr(self, "keep_part", None)  # verified_reduce: the claims it answers with
                if keep is not None:
                    keep(self.current_part_index, senders, parts, weights, result)
                self.current_part_future.set_result(result)
            self.reset_accumulators()

    reducer.reset_accumulators = reset_accumulators
    reducer.on_sender_failed = on_sender_failed
    reducer.accumulate_part = accumulate_part
    reducer.check_current_part_finished = check_current_part_finished

    container = partition.TensorPartContainer
    register = container.register_processed_part

    def register_processed_part(self, peer_index: int, part_index: int, part) -> None:
        if not robust.finite(part):  # a reducer's average with NaN/inf: none of its parts is used
            names = getattr(self, "reducer_names", None)
            peer = names[peer_index] if names else f"reducer {peer_index}"
            log.warning("%s returned average %d with NaN or inf: the round fails", peer, part_index)
            robust.strike(peer, "returned a NaN or inf average")
            raise partition.AllreduceException(f"{peer} returned a non-finite average")
        register(self, peer_index, part_index, part)

    container.register_processed_part = register_processed_part
    runner_init = allreduce.AllReduceRunner.__init__

    def init(self, *args, **kwargs) -> None:
        runner_init(self, *args, **kwargs)
        self.tensor_part_reducer.sender_names = [str(p) for p in self.sender_peer_ids]
        self.tensor_part_container.reducer_names = [str(p) for p in self.ordered_peer_ids]

    allreduce.AllReduceRunner.__init__ = init

    mm = matchmaking.Matchmaking
    check, request = mm._check_reasons_to_reject, mm._request_join_group

    def _check_reasons_to_reject(self, request_msg, context):
        if robust.banned(str(context.remote_id)):
            return averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
        return check(self, request_msg, context)

    async def _request_join_group(self, leader):
        if robust.banned(str(leader)):
            return None
        return await request(self, leader)

    mm._check_reasons_to_reject = _check_reasons_to_reject
    mm._request_join_group = _request_join_group

    avg = averager.DecentralizedAverager
    download, stub_for = avg.rpc_download_state, avg.get_stub.__func__

    @functools.wraps(download)  # hivemind builds its handler from the names and annotations
    async def rpc_download_state(self, _request, _context):
        if robust.banned(str(_context.remote_id)):
            return
        async for message in download(self, _request, _context):
            yield message

    async def no_state():
        return
        yield

    async def refuse_download(*_args, **_kwargs):
        return no_state()

    def get_stub(cls, p2p, peer, *, namespace=None):
        stub = stub_for(cls, p2p, peer, namespace=namespace)
        if robust.banned(str(peer)):  # an empty answer: _load_state_from_peers and prefetch try the next peer
            stub.rpc_download_state = refuse_download
        return stub

    avg.rpc_download_state = rpc_download_state
    avg.get_stub = classmethod(get_stub)
