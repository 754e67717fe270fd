"""When a volunteer publishes its metrics record: once per global step, not more often than every
METRICS_GAP seconds, and every METRICS_PERIOD seconds while no step comes."""

from dedloc_core.engine.training import METRICS_GAP, METRICS_PERIOD, metrics_due


def test_the_first_record_goes_at_once():
    assert metrics_due((-1, float("-inf")), 0, 0.0)


def test_a_new_step_publishes_once_the_gap_has_passed():
    assert not metrics_due((3, 100.0), 4, 100.0 + METRICS_GAP - 0.1)
    assert metrics_due((3, 100.0), 4, 100.0 + METRICS_GAP)


def test_within_a_step_only_the_period_publishes():
    assert not metrics_due((3, 100.0), 3, 100.0 + METRICS_GAP)
    assert not metrics_due((3, 100.0), 3, 100.0 + METRICS_PERIOD - 0.1)
    assert metrics_due((3, 100.0), 3, 100.0 + METRICS_PERIOD)


def test_steps_faster_than_the_gap_publish_at_most_every_gap():
    published, records = (-1, float("-inf")), 0
    for tick in range(600):  # 60 s, a report every 0.1 s, a new step every 0.5 s
        now, epoch = tick * 0.1, tick // 5
        if metrics_due(published, epoch, now):
            published, records = (epoch, now), records + 1
    assert records == 60 // METRICS_GAP
