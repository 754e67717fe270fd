"""A partial all-reduce is a failed round, and our own reducer never hangs us.

Upstream: ``hivemind/averaging/allreduce.py``: ``AllReduceRunner.run`` and
``_communicate_with_peer`` (wrapped); ``hivemind/averaging/partition.py``:
``TensorPartContainer.register_failed_reducer`` (wrapped).

Without it: a peer that misses a reducer's results (the reducer vanished or timed out) logs
"received 54 % of results" and goes on with its local values for those parts: the group's peers
end the round with different tensors (in DiLoCo, two rounds merged). hivemind does not expect our
own reducer to fail us: when it does (our own parts dropped for NaN by ``robust_reduce``), ``run``
waits for ever. (A reducer that lost a *sender* averages the others' parts and sends every peer
the same average: that round goes on without the sender, as in hivemind.)

Fix: a peer that misses any reducer's results raises in ``AllReduceRunner.run`` before the next
output, and keeps its local state (where the lost reducer is another peer, ``no_rerun`` runs
the step once more among the survivors). A peer whose own parts were dropped still reduces the others'
parts to the end, then its own reducer counts as failed (it keeps its local values).

Kind: bug fix (belongs upstream; docs/hivemind/robust_reduce.patch)

Shown: ``tests/test_robust.py`` (slow: a round that lost a peer's parts fails with this and passes for
a success without).
"""

from __future__ import annotations

from . import no_rerun

REPLACES = [
    "hivemind.averaging.allreduce.AllReduceRunner.run",
    "hivemind.averaging.allreduce.AllReduceRunner._communicate_with_peer",
    "hivemind.averaging.partition.TensorPartContainer.register_failed_reducer",
]


def install() -> None:
    from hivemind.averaging import allreduce, partition

    container = partition.TensorPartContainer
    register_failed = container.register_failed_reducer

    def register_failed_reducer(self, peer_index: int) -> None:
        self.failed_reducers = [*getattr(self, "failed_reducers", ()), peer_index]
        register_failed(self, peer_index)

    container.register_failed_reducer = register_failed_reducer
    communicate = allreduce.AllReduceRunner._communicate_with_peer

    async def _communicate_with_peer(self, peer_id) -> None:
        try:
            await communicate(self, peer_id)
        except Exception as exc:
            if peer_id == self.peer_id:  # hivemind does not expect our own reducer to fail us: it would hang
                if isinstance(exc, partition.BannedException):  # our parts were dropped (NaN): still reduce
                    await self.tensor_part_reducer.finished.wait()  # the others' parts to the end
                self.tensor_part_container.register_failed_reducer(self.ordered_peer_ids.index(peer_id))
            raise

    allreduce.AllReduceRunner._communicate_with_peer = _communicate_with_peer
    run = allreduce.AllReduceRunner.run

    async def run_whole(self):
        container = self.tensor_part_container
        async for delta in run(self):  # each output comes once all its parts are in (averaged or failed)
            if container.failed_size:  # a reducer's parts are missing: a partial all-reduce is a failed round
                names = getattr(container, "reducer_names", None)
                failed = getattr(container, "failed_reducers", ())
                missing = ", ".join(f"...{names[i][-6:]}" if names else str(i) for i in failed)
                if failed and self.ordered_peer_ids.index(self.peer_id) not in failed:
                    no_rerun.grant_rerun()  # another reducer is lost: the group's survivors all lost it
                raise partition.AllreduceException(
                    f"partial all-reduce in {self._prefix}: {container.failed_size} of {container.total_size} "
                    f"values not averaged (no average from {missing})")
            yield delta

    allreduce.AllReduceRunner.run = run_whole
