"""A round that ran is not run again, except once among the survivors of a lost reducer.

Upstream: ``hivemind/averaging/control.py``, ``StepControl.allow_retries`` (a property, wrapped)
and ``StepControl.deadline`` (its ``_deadline`` cut for a rerun);
its reader is ``DecentralizedAverager._step`` (``averaging/averager.py``, wrapped to know its
step), whose retry loop this relies on line by line.

Without it: ``_step`` retries a step whose all-reduce had begun and failed, looking for a new
group until the step's deadline (the averaging timeout). The group it ran with has dissolved, and
in a synchronous swarm the other peers have moved on (one whose last part went missing is the
only one to see the round fail): a newcomer's parameter round in ``bench/join_time.py`` finds no
group for 25 s while its training loop waits for it ("Allreduce group not found" every 2-6 s).
Yet when a reducer is killed mid-round, every member of the group loses its parts at once, and
with no retry at all the whole group (about 15 peers in ``bench/scale.py``) stepped on its own.

Fix: ``allow_retries`` is False once the all-reduce began: the step fails at once and the
optimizer goes on with its local gradients or parameters. A step that has not found a group yet
still retries until its deadline. One exception: a round that failed for want of another
reducer's averages (``partial_rounds`` calls ``grant_rerun``) is run again once, its deadline cut
to ``RERUN_MATCHMAKING`` matchmaking times from now: the survivors, who all failed within a round
trip, find each other and average again (tensors already averaged are equal among them, so they
stay as they are). A peer alone in its failure finds nobody and fails a few seconds later.

Kind: bug fix (belongs upstream; docs/hivemind/no_rerun.patch), and our policy (the one rerun)

Shown: ``tests/test_hivemind_ext.py`` (slow: the victim's step retries without this);
``tests/test_robust.py`` (slow: the survivors of a vanished reducer average again, and fail
without the rerun; the first is xfail for an open bug: the rerun's reducer may end a survivor's
answer stream before its last parts).
"""

from __future__ import annotations

import contextvars

REPLACES = [
    "hivemind.averaging.control.StepControl.allow_retries",
    "hivemind.averaging.control.StepControl.deadline",  # reads _deadline, which grant_rerun cuts
    "hivemind.averaging.averager.DecentralizedAverager._step",
]

RERUN_MATCHMAKING = 2.0  # the rerun's deadline, in the averager's matchmaking times (plus RERUN_MARGIN)
RERUN_MARGIN = 2.0  # seconds
_step: contextvars.ContextVar = contextvars.ContextVar("dedloc_averaging_step", default=None)


def grant_rerun() -> bool:
    """Let the step whose round fails now (in this task) run once more, among the peers that lost
    the same reducer; False if it already had its rerun (or runs outside a step)."""
    from hivemind.utils import get_dht_time

    found = _step.get()
    if found is None:
        return False
    step, window = found
    if getattr(step, "reran", False):
        return False
    step.reran = step.rerun_pending = True
    step._deadline = min(step.deadline, get_dht_time() + window)  # this process's copy: its search and retries
    return True


def install() -> None:
    from hivemind.averaging.averager import DecentralizedAverager
    from hivemind.averaging.control import StepControl

    allowed = StepControl.allow_retries.fget

    def allow_retries(self) -> bool:  # read once per failed attempt, by _step
        if allowed(self) and getattr(self, "rerun_pending", False):
            self.rerun_pending = False
            return True
        return allowed(self) and not self.began_allreduce

    StepControl.allow_retries = property(allow_retries)
    step_impl = DecentralizedAverager._step

    async def _step_known(self, *, step, future_for_init):
        window = RERUN_MATCHMAKING * self._matchmaking.min_matchmaking_time + RERUN_MARGIN
        _step.set((step, window))  # the tasks it starts (matchmaking, all-reduce) copy this context
        return await step_impl(self, step=step, future_for_init=future_for_init)

    DecentralizedAverager._step = _step_known
