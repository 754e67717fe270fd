"""A cancelled step stays cancelled: the averager never runs a round nobody waits for.

Upstream: ``hivemind/averaging/control.py``, ``StepControl.cancel`` (replaced whole); its reader
is ``DecentralizedAverager._step`` (``averaging/averager.py``).

Without it: ``cancel`` tells the averager first (its trigger and cancel futures) and sets its own
state to cancelled last. ``_step`` wakes on that news and reads ``step.cancelled()``, which can
still be False; it goes on with matchmaking, finds that the cancelled trigger counts as
"triggered", and runs a whole all-reduce for a step nobody waits for (its end: "Can't set_result
to a future that is CANCELLED"). hivemind.Optimizer cancels its pre-scheduled gradient round
whenever it sees no other peer, which is often as peers come and go. The zombie round holds the
averager's matchmaking ("Another look_for_group is already in progress"), takes the group another
peer meant for its real step, and leaves this peer's real round without one until the averaging
timeout (most failed rounds and 30 s stalls of two peers on loopback begin so). A second cancel
raises ``InvalidStateError`` (setting the cancel future again, e.g. in ``Optimizer.shutdown``).

Fix: the state is set first, then the averager is told; a second cancel does nothing.

Kind: bug fix (belongs upstream; docs/hivemind/step_cancel.patch)

Shown: ``tests/test_hivemind_ext.py`` (what the averager reads when each message arrives).
"""

from __future__ import annotations

REPLACES = ["hivemind.averaging.control.StepControl.cancel"]


def install() -> None:
    from hivemind.averaging.control import StepControl
    from hivemind.utils.mpfuture import MPFuture

    def cancel(self) -> bool:
        cancelled = MPFuture.cancel(self)  # the shared state, read by the averager when it hears below
        if self._trigger is not None:
            self._trigger.cancel()
        if self._cancel is not None and not self._cancel.done():  # a second cancel is a no-op, as for a future
            self._cancel.set_result(None)
        return cancelled

    StepControl.cancel = cancel  # type: ignore[method-assign]
