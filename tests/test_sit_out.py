"""A peer whose last step's round is still looking for a group when its next step comes (one round
behind the swarm) sits that step out: no round, no optimizer step, its samples kept; once the swarm
has taken the step it goes on at the swarm's step number with them, and its optimizer takes its next
step twice
(``swarm.RoundCountingOptimizer._update_global_epoch``). So does a peer whose swarm took the step
before it, unless its pre-scheduled round sits in the swarm's group. Real hivemind DHTs and averagers
on loopback; the late round is a real StepControl in the stage a late round is in."""

from __future__ import annotations

import pytest
from probes import run_probe

pytestmark = pytest.mark.slow  # starts workers, swarms or hivemind peers: not in make test-fast

PROBE = """
import sys, time
from functools import partial
import hivemind, torch
from hivemind.averaging.control import AveragingStage, StepControl
from hivemind.optim.progress_tracker import ProgressTracker
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.mpfuture import MPFuture
from dedloc_core.engine import swarm
from tests.probes import FAST_TRACKER, two_dhts, until

run_id = "sit_out_probe"
first, other = two_dhts()
model = torch.nn.Linear(4, 2)
opt = swarm.RoundCountingOptimizer(
    dht=first, run_id=run_id, params=model.parameters(), optimizer=partial(torch.optim.Adam, lr=0.1),
    target_batch_size=1000, batch_size_per_step=4, averaging_timeout=5.0, matchmaking_time=1.0, verbose=False,
    offload_optimizer=True, delay_optimizer_step=True, delay_grad_averaging=True, delay_state_averaging=True,
    tracker_opts=FAST_TRACKER if "-un" not in sys.argv[1] else dict(min_refresh_period=600, max_refresh_period=600))
if sys.argv[1] == "plain":  # hivemind's own step
    swarm.RoundCountingOptimizer._update_global_epoch = hivemind.Optimizer._update_global_epoch
# another peer; trackers in one process share a key (and so one record) unless given one of their own:
# for a late round the swarm must count two peers (alone, ours would look for nobody)
own_key = dict(private_key=RSAPrivateKey()) if sys.argv[1] in ("patched", "all-late", "far-behind") else {}
swarm_peer = ProgressTracker(dht=other, prefix=run_id, target_batch_size=1000, start=True, **own_key)
if own_key:  # (hivemind publishes a peer's progress once it has samples)
    swarm_peer.report_local_progress(local_epoch=0, samples_accumulated=1)

model(torch.randn(4, 4)).sum().backward()
opt.step()  # one micro-batch: 4 samples accumulated, far from the target
if "-un" not in sys.argv[1]:  # (a slow tracker read the swarm once, as it started)
    until(opt.tracker.fetched_global_progress_this_epoch.is_set, "the tracker never fetched the swarm's progress")
if sys.argv[1] == "far-behind":  # we are at step 10; the other peer, back from a pause, at step 0
    opt.state_averager.local_epoch = 10
    opt.tracker.report_local_progress(local_epoch=10, samples_accumulated=4)
    until(lambda: opt.tracker.global_epoch == 10, "the tracker never saw our step 10")
if own_key:
    until(lambda: opt.tracker.global_progress.num_peers == 2, "the tracker never counted the other peer")
before = [p.detach().clone() for p in model.parameters()]
MPFuture()  # hivemind starts its future backend on the base class only
if sys.argv[1].startswith("behind"):  # the swarm took step 0 before our tracker saw it
    took = []
    hivemind.Optimizer._update_global_epoch = lambda self, scaler: took.append(self.local_epoch)  # a step
    if sys.argv[1] == "behind-grouped":  # our pre-scheduled round sits in the swarm's group, untriggered
        ready = StepControl(scheduled_time=get_dht_time() + 5, deadline=get_dht_time() + 30, allow_retries=True,
                            weight=1.0, data_for_gather=b"")
        ready.attach(MPFuture(), MPFuture())
        ready.stage = AveragingStage.AWAITING_TRIGGER
        opt.scheduled_grads = ready
    if sys.argv[1] in ("behind-joining", "behind-looking"):  # our round looks for a group, untriggered
        looking = StepControl(scheduled_time=get_dht_time() + 5, deadline=get_dht_time() + 30, allow_retries=True,
                              weight=1.0, data_for_gather=b"")
        looking.attach(MPFuture(), MPFuture())
        looking.stage = AveragingStage.LOOKING_FOR_GROUP
        opt.scheduled_grads, opt.JOIN_GRACE = looking, 0.5
    if sys.argv[1] == "behind-joins-now":  # the leader's word comes between two looks at our round
        class JoinsWhileAsked(StepControl):
            reads = 0

            @property
            def stage(self):
                JoinsWhileAsked.reads += 1
                return AveragingStage.LOOKING_FOR_GROUP if self.reads == 1 else AveragingStage.AWAITING_TRIGGER

            @stage.setter
            def stage(self, value):
                pass

        joins = JoinsWhileAsked(scheduled_time=get_dht_time() + 5, deadline=get_dht_time() + 30,
                                allow_retries=True, weight=1.0, data_for_gather=b"")
        joins.attach(MPFuture(), MPFuture())
        opt.scheduled_grads = joins
    if sys.argv[1] == "behind-unchecked":  # as before: no look at the swarm's step
        swarm.RoundCountingOptimizer._in_a_group = staticmethod(lambda scheduled: True)
    swarm_peer.report_local_progress(local_epoch=1, samples_accumulated=5)
    if "-un" in sys.argv[1]:  # our tracker reads the swarm every 10 minutes: it has not seen the step
        def stored_epochs():
            found = first.get(run_id + "_progress", latest=True)
            return [v.value["epoch"] for v in found.value.values()] if found is not None else []
        until(lambda: 1 in stored_epochs(), "the swarm's step 1 was never stored")
        if sys.argv[1] == "behind-unlooked":
            opt._look_at_the_swarm = lambda: None
    else:
        until(lambda: opt.tracker.global_epoch == 1, "the swarm's step 1 never reached the tracker")
    if sys.argv[1] in ("behind-joining", "behind-looking"):
        opt._update_global_epoch(None)  # it may be joining the swarm's group this moment: wait
        print(took, opt.local_epoch, end=" ")
        if sys.argv[1] == "behind-joining":
            looking.stage = AveragingStage.AWAITING_TRIGGER  # the leader's word came: in the group
        else:
            opt._joining_since -= opt.JOIN_GRACE  # no word within the grace (no sleep: the tracker
            # shares its record's key with swarm_peer here, and a refetch could read our own epoch 0)
    opt._update_global_epoch(None)
    print(took, opt.local_epoch, opt.grad_averager.local_samples_accumulated, opt.steps_sat_out, flush=True)
    if sys.argv[1] == "behind-looking":  # our round for the step the swarm took: no longer looking
        print(looking.cancelled(), opt.scheduled_grads is None)
    swarm_peer.shutdown(); opt.shutdown(); other.shutdown(); first.shutdown()
    sys.exit(0)
if sys.argv[1].startswith("group"):  # the swarm reached the target; nobody has stepped yet
    took = []
    hivemind.Optimizer._update_global_epoch = lambda self, scaler: took.append(self.local_epoch)  # a step
    due = 5 if sys.argv[1] != "group-overdue" else -1.5  # our round's scheduled time, from now
    ours = StepControl(scheduled_time=get_dht_time() + due, deadline=get_dht_time() + 30, allow_retries=True,
                       weight=1.0, data_for_gather=b"")
    ours.attach(MPFuture(), MPFuture())
    ours.stage = AveragingStage.AWAITING_TRIGGER if sys.argv[1] == "group-formed" else AveragingStage.LOOKING_FOR_GROUP
    opt.scheduled_grads = ours
    if sys.argv[1] != "group-formed":  # our tracker's view, set here: another peer, the target reached
        import dataclasses
        opt.tracker.shutdown()  # (no refetch over it)
        opt._look_at_the_swarm = lambda: None
        opt.tracker.global_progress = dataclasses.replace(opt.tracker.global_progress, num_peers=2,
                                                          samples_accumulated=1000)
    if sys.argv[1] == "group-formed":  # our tracker: far from the target (4 of 1000 samples)
        print(opt.tracker.ready_to_update_epoch, end=" ")
        ours.scheduled_time = get_dht_time() - 0.1  # the group's time has come
        print(opt.tracker.ready_to_update_epoch)
    else:
        opt._update_global_epoch(None)
        print(took, opt.local_epoch, end=" ")
        ours.stage = AveragingStage.AWAITING_TRIGGER  # its group formed
        opt._update_global_epoch(None)
        print(took, opt.local_epoch, opt.steps_sat_out)
    swarm_peer.shutdown(); opt.shutdown(); other.shutdown(); first.shutdown()
    sys.exit(0)
late = StepControl(scheduled_time=get_dht_time() - 5, deadline=get_dht_time() + 30, allow_retries=True,
                   weight=1.0, data_for_gather=b"")
trigger, cancel = MPFuture(), MPFuture()
late.attach(trigger, cancel)
late.allow_allreduce()  # the last step's round: triggered, still looking for a group
late.stage = AveragingStage.LOOKING_FOR_GROUP
opt.scheduled_grads = late
opt._update_global_epoch(None)  # the swarm reached the target of step 0
print(opt.local_epoch, opt.grad_averager.local_samples_accumulated, opt.steps_sat_out, flush=True)
if sys.argv[1] == "patched":
    opt._update_global_epoch(None)  # the next micro-batch, the swarm still at step 0
    again = opt.local_epoch
    late.cancel()  # the late round ended; the swarm is still finishing step 0, due now
    opt.tracker.global_progress.eta_next_epoch = get_dht_time()
    opt._maybe_schedule_gradient_averaging()
    again = f"{again} {opt.scheduled_grads is late}"  # no round for the step sat out
    # the swarm took step 0 (trackers in one process share a key: this record replaces ours)
    swarm_peer.report_local_progress(local_epoch=1, samples_accumulated=5)
    until(lambda: opt.tracker.global_epoch == 1, "the swarm's step 1 never reached the tracker")
    opt._update_global_epoch(None)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    print(again, opt.local_epoch, opt.grad_averager.local_samples_accumulated, unchanged)
    adam = opt.state_averager.optimizer
    count = lambda: int(adam.state[adam.param_groups[0]["params"][0]]["step"])
    swarm_peer.shutdown()  # the other peer leaves: our step 1 finds no group and takes local gradients
    until(lambda: opt.tracker.global_progress.num_peers == 1, "the tracker still counts the peer that left")
    before_steps = count()
    opt._update_global_epoch(None)  # step 1, and the one owed
    opt.state_averager.step(wait_for_delayed_updates=True)
    print(opt.local_epoch, count() - before_steps)
elif sys.argv[1] in ("alone", "far-behind"):  # no other peer in step: the late round looks for nobody
    print(late.cancelled(), opt.scheduled_grads is not late)
elif sys.argv[1] == "all-late":  # the late round ends and the swarm is still at step 0: nobody moves on
    late.cancel()
    opt._update_global_epoch(None)
    print(opt.local_epoch, opt.grad_averager.local_samples_accumulated)
late.cancel()
swarm_peer.shutdown()
opt.shutdown()
other.shutdown()
first.shutdown()
"""


def probe(mode: str) -> str:
    return " ".join(run_probe(PROBE, mode, timeout=180).split())


def test_a_peer_a_round_behind_sits_the_step_out_and_goes_on_with_its_samples():
    # step 0 sat out (epoch 0, 4 samples kept, one sit-out), still out while the swarm finishes it
    # (and no round scheduled meanwhile), then the swarm's step 1 with the 4 samples; no optimizer
    # step touched the parameters. The next global step takes two optimizer steps, its own and the
    # one sat out, so that Adam's step count and moments stay the swarm's (OwedSteps)
    assert probe("patched") == "0 4 1 0 True 1 4 True 2 2"


def test_when_the_late_round_ends_before_the_swarm_moves_on_the_peer_takes_the_step():
    # every peer was late (rounds outlasting steps) and sat out: waiting for the swarm would wait for ever
    assert probe("all-late") == "0 4 1 1 0"


def test_alone_a_late_round_is_cancelled_and_the_step_taken():
    # the swarm counts only us (the other peer paused or left): no sit-out waiting out the round's
    # deadline; the round is cancelled (its delayed step takes our local gradients) and we step
    assert probe("alone") == "1 0 0 True True"


def test_beside_a_peer_far_behind_a_late_round_is_cancelled_and_the_step_taken():
    # the other peer is counted, 10 steps behind: it loads the swarm's state before it joins a round.
    # Our delayed step waited in the round for it, so we served no whole step, and its downloads of
    # our state timed out until the round's deadline
    assert probe("far-behind") == "11 0 0 True True"


def test_hivemind_steps_at_once_and_its_samples_go_to_a_round_of_their_own():
    assert probe("plain") == "1 0 0"  # (a round that would join the swarm's next one)


def test_a_peer_that_saw_the_swarm_step_late_goes_on_at_its_step_without_a_round():
    # no step of its own (a round begun now would join the swarm's next group: a round behind for
    # good), the swarm's step number, its 4 samples kept for that step's round, one step sat out
    assert probe("behind") == "[] 1 4 1"


def test_a_peer_whose_round_sits_in_the_swarms_group_takes_the_step():
    assert probe("behind-grouped") == "[0] 0 4 0"  # the group waits for its trigger


def test_without_the_check_the_late_peer_steps_into_the_swarms_next_round():
    assert probe("behind-unchecked") == "[0] 0 4 0"


def test_a_peer_whose_round_is_in_no_group_reads_the_swarm_before_it_steps():
    assert probe("behind-unseen") == "[] 1 4 1"  # its tracker's next read was 10 minutes away


def test_without_that_read_it_steps_on_its_old_look_at_the_swarm():
    assert probe("behind-unlooked") == "[0] 0 4 0"


def test_a_round_that_may_be_joining_the_swarms_group_gets_a_moment_to_hear_it():
    # first call: no step, no going on; the round is then in the group: the step is taken
    assert probe("behind-joining") == "[] 0 [0] 0 4 0"


def test_a_round_that_joins_the_swarms_group_while_the_peer_looks_takes_the_step():
    # the round read as looking, then as in the group: going on would leave the group waiting for
    # its trigger until this peer's next step (a newcomer in bench/join_time.py, 2 runs of 2)
    assert probe("behind-joins-now") == "[0] 0 4 0"


def test_a_round_that_hears_nothing_within_the_grace_goes_on_without_the_step():
    # and its round is cancelled: left looking, it could join the group of the step the swarm took
    # and hold it waiting for a trigger that comes a step later
    assert probe("behind-looking") == "[] 0 [] 1 4 1 True True"


def test_a_peer_whose_round_still_looks_for_its_group_accumulates_until_the_group_forms():
    # the swarm reached the target, nobody stepped: no step while the round looks (its group is due
    # in 5 s), the step once it is in the group. Stepping at once (hivemind) made the others, whose
    # rounds looked too, see the swarm step without them and go on: the going-on cascade
    assert probe("group-forming") == "[] 0 [0] 0 0"


def test_a_round_still_looking_past_its_time_and_the_grace_takes_the_step_at_once():
    assert probe("group-overdue") == "[0] 0 [0, 0] 0 0"  # (as hivemind: a round that found no group)


def test_a_round_in_its_group_past_its_time_makes_the_step_due_whatever_the_tracker_read():
    # 4 samples of 1000 by the tracker's last read: not due before the group's time, due after it
    assert probe("group-formed") == "False True"
