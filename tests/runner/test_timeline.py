import pytest

from diloco.runner.timeline import Interval, Rollback, Timeline, compute_goodput, goodput_of


def test_no_failures_and_no_blocking_is_full_goodput() -> None:
    timeline = Timeline()
    for learner in range(3):
        timeline.enter(learner, "training", 0.0)
    timeline.close(10.0)
    g = goodput_of(timeline)
    assert g.total_s == pytest.approx(30)
    assert g.goodput == pytest.approx(1.0)


def test_goodput_counts_down_starting_blocked_and_rolled_back_time() -> None:
    timeline = Timeline()
    timeline.enter(0, "starting", 0.0)
    timeline.enter(0, "training", 2.0)
    timeline.enter(0, "down", 10.0)  # killed
    timeline.enter(0, "starting", 14.0)  # restarted
    timeline.enter(0, "training", 16.0)  # rejoined
    timeline.leave(0, 20.0)  # finished its steps
    timeline.enter(1, "training", 0.0)
    timeline.close(20.0)
    timeline.record_blocked(1, 0, 1.0)
    timeline.record_blocked(1, 0, 3.0)  # cumulative: the largest value counts
    timeline.record_blocked(0, 0, 0.5)
    timeline.rollbacks.append(Rollback(learner=0, at_s=16.0, from_step=40, to_step=32, step_time_s=0.25))
    g = goodput_of(timeline)
    assert g.total_s == pytest.approx(40)
    assert g.training_s == pytest.approx(8 + 4 + 20)
    assert g.down_s == pytest.approx(4)
    assert g.starting_s == pytest.approx(4)
    assert g.blocked_s == pytest.approx(3.5)
    assert g.lost_s == pytest.approx(2.0)
    assert g.useful_s == pytest.approx(32 - 3.5 - 2.0)
    assert g.goodput == pytest.approx((32 - 5.5) / 40)


def test_entering_the_same_phase_twice_keeps_one_interval() -> None:
    timeline = Timeline()
    timeline.enter(0, "training", 0.0)
    timeline.enter(0, "training", 5.0)
    timeline.close(6.0)
    assert timeline.intervals == [Interval(0, "training", 0.0, 6.0)]


def test_timeline_round_trips_through_its_dict_form() -> None:
    timeline = Timeline()
    timeline.enter(0, "training", 0.0)
    timeline.enter(0, "down", 3.0)
    timeline.close(4.0)
    timeline.record_blocked(0, 0, 0.7)
    timeline.rollbacks.append(Rollback(0, 3.0, 10, 8, 0.1))
    again = Timeline.from_dict(timeline.to_dict())
    assert again.intervals == timeline.intervals
    assert again.rollbacks == timeline.rollbacks
    assert again.blocked_s == timeline.blocked_s
    assert goodput_of(again) == goodput_of(timeline)


def test_empty_timeline_has_no_goodput_and_blocked_time_is_capped_by_training() -> None:
    assert compute_goodput([], {}, []).goodput is None
    g = compute_goodput([Interval(0, "training", 0, 1)], {(0, 0): 5.0}, [])
    assert g.blocked_s == pytest.approx(1.0)
    assert g.goodput == pytest.approx(0.0)


def test_blocked_time_of_a_resumed_incarnation_counts_only_what_it_added() -> None:
    timeline = Timeline()
    timeline.record_blocked(0, 0, 2.0)
    timeline.record_blocked(0, 0, 4.0)
    timeline.record_blocked(0, 1, 3.0)  # restored from a checkpoint taken at 3.0 s
    timeline.record_blocked(0, 1, 5.5)
    assert timeline.blocked_s == {(0, 0): 4.0, (0, 1): 2.5}
