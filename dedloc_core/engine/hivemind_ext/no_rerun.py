"""A round that ran is not run again: a step whose all-reduce began and failed fails at once.

Upstream: ``hivemind/averaging/control.py``, ``StepControl.allow_retries`` (a property, wrapped);
its reader is ``DecentralizedAverager._step`` (``averaging/averager.py``), whose retry loop this
relies on line by line.

Without it: ``_step`` retries a step whose all-reduce had begun and failed, looking for a new
group until the step's deadline (the averaging timeout). The group it ran with has dissolved, and
in a synchronous swarm the other peers have moved on (one whose last part went missing is the
only one to see the round fail): a newcomer's parameter round in ``bench/join_time.py`` finds no
group for 25 s while its training loop waits for it ("Allreduce group not found" every 2-6 s).

Fix: ``allow_retries`` is False once the all-reduce began: the step fails at once and the
optimizer goes on with its local gradients or parameters. A step that has not found a group yet
still retries until its deadline.

Kind: bug fix (belongs upstream; docs/hivemind/no_rerun.patch)

Shown: ``tests/test_hivemind_ext.py`` (slow: the victim's step retries without this).
"""

from __future__ import annotations

REPLACES = [
    "hivemind.averaging.control.StepControl.allow_retries",
    "hivemind.averaging.averager.DecentralizedAverager._step",
]


def install() -> None:
    from hivemind.averaging.control import StepControl

    allowed = StepControl.allow_retries.fget
    StepControl.allow_retries = property(lambda self: allowed(self) and not self.began_allreduce)
