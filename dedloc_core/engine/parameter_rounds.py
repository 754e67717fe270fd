"""A step does not wait for a parameter round that found no group.

With delayed updates (overlap) a step's parameter round (every ``average_state_every`` steps) runs
in the background, and the next step begins by waiting for it ("Waiting for delayed updates"). The
swarm's peers begin that round at the same step's end, within a second, unless they skipped the
step's round (a peer that sat the step out, or went on from a state loaded as the swarm stepped). A
round that nobody joins looks for a group until its deadline, the averaging timeout, or until the
others' next parameter round joins it: in ``bench/join_time.py`` a volunteer stood still 19-25 s, and
the newcomer's first round waited for it. Here the wait leaves such a round once it is
``GROUP_GRACE`` past its scheduled time and still looking: this peer keeps its own parameters until
the next parameter round."""

from __future__ import annotations

import logging
import time

from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.utils import get_dht_time

logger = logging.getLogger(__name__)

GROUP_GRACE = 1.0  # seconds past its scheduled time a parameter round gets to form its group
POLL = 0.05


class KeepsItsParameterRounds(DecentralizedAverager):
    """Keeps the controls of its averaging rounds that have not ended: the state averager's rounds
    are parameter rounds. hivemind's ``TrainingStateAverager`` begins them through ``super().step``
    (``schedule_step`` and its background ``_do``), so this class comes after it in the bases."""

    def step(self, *args, **kwargs):
        control = super().step(*args, **kwargs)
        if isinstance(control, StepControl):
            self.parameter_rounds = [c for c in getattr(self, "parameter_rounds", ()) if not c.done()] + [control]
        return control


class LeavesLoneParameterRounds:
    """A ``TrainingStateAverager`` whose wait for delayed updates leaves a parameter round that is
    still looking for a group ``GROUP_GRACE`` after its scheduled time (it comes before hivemind's
    class in the bases; ``KeepsItsParameterRounds`` after it)."""

    parameter_rounds_left = 0  # rounds left for want of a group

    def step(self, *args, wait_for_delayed_updates: bool | None = None, **kwargs):
        if wait_for_delayed_updates:
            self._wait_leaving_lone_rounds()
        return super().step(*args, wait_for_delayed_updates=wait_for_delayed_updates, **kwargs)

    def _wait_leaving_lone_rounds(self) -> None:
        """Until the delayed updates end, no parameter round is live, or hivemind's own timeout for
        this wait has passed (its wait follows, with that timeout)."""
        deadline = time.monotonic() + (self._allreduce_timeout or float("inf"))
        while any(not update.done() for update in self.pending_updates) and time.monotonic() < deadline:
            live = [c for c in getattr(self, "parameter_rounds", ()) if not c.done()]
            if not live:
                return
            for control in live:
                if (control.triggered and control.stage == AveragingStage.LOOKING_FOR_GROUP
                        and get_dht_time() > control.scheduled_time + GROUP_GRACE):
                    logger.info("Our parameter round of step %d found no group: left (our parameters stay ours)",
                                self.local_epoch - 1)
                    control.cancel()
                    self.parameter_rounds_left += 1
            time.sleep(POLL)
