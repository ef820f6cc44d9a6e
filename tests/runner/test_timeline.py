import pytest

from diloco.runner.timeline import Interval, Rollback, Timeline, compute_goodput, goodput_of, launch_durations


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


def test_start_up_is_the_time_before_each_learner_first_trained_and_the_rest_is_steady_state() -> None:
    timeline = Timeline()
    timeline.enter(0, "starting", 0.0)
    timeline.enter(0, "down", 3.0)  # killed while starting: still the job's start-up
    timeline.enter(0, "starting", 5.0)
    timeline.enter(0, "training", 7.0)
    timeline.enter(0, "down", 15.0)  # a later failure: steady state
    timeline.enter(0, "starting", 17.0)
    timeline.enter(0, "training", 19.0)
    timeline.enter(1, "starting", 0.0)
    timeline.enter(1, "training", 2.0)
    timeline.enter(2, "starting", 0.0)  # never trained: all start-up
    timeline.close(20.0)
    g = goodput_of(timeline)
    assert g.startup_s == pytest.approx(7 + 2 + 20)
    assert g.steady_s == pytest.approx(60 - 29)
    assert g.useful_s == pytest.approx(8 + 1 + 18)
    assert g.steady_goodput == pytest.approx(27 / 31)
    assert g.goodput == pytest.approx(27 / 60)
    assert g.to_dict()["steady_goodput"] == g.steady_goodput


def test_a_launch_trains_from_the_first_step_its_process_reported() -> None:
    timeline = Timeline()
    timeline.enter(0, "starting", 0.0)
    timeline.enter(1, "starting", 0.0)
    timeline.enter(0, "training", 6.0)  # the status polls saw it training at 6 s
    timeline.enter(0, "down", 20.0)
    timeline.enter(0, "starting", 22.0)
    timeline.enter(0, "training", 30.0)
    timeline.close(40.0)
    timeline.move_training_start(0, 0.0, 4.5)  # its first step ended at 4.5 s
    timeline.move_training_start(0, 22.0, 27.0)
    timeline.move_training_start(0, 22.0, 45.0)  # outside the two intervals: ignored
    timeline.move_training_start(1, 0.0, 3.0)  # never trained: nothing to move
    assert [(i.phase, i.start_s, i.end_s) for i in timeline.intervals if i.learner == 0] == [
        ("starting", 0.0, 4.5),
        ("training", 4.5, 20.0),
        ("down", 20.0, 22.0),
        ("starting", 22.0, 27.0),
        ("training", 27.0, 40.0),
    ]
    assert [(i.phase, i.start_s, i.end_s) for i in timeline.intervals if i.learner == 1] == [
        ("starting", 0.0, 40.0)
    ]


def test_launch_durations_count_only_launches_that_reached_training() -> None:
    timeline = Timeline()
    timeline.enter(0, "starting", 0.0)
    timeline.enter(0, "training", 4.0)  # first launch: 4 s
    timeline.enter(0, "down", 10.0)
    timeline.enter(0, "starting", 12.0)
    timeline.enter(0, "down", 13.0)  # killed while starting: says nothing about a restart's length
    timeline.enter(0, "starting", 15.0)
    timeline.enter(0, "training", 18.0)  # a restart: 3 s
    timeline.enter(1, "starting", 0.0)
    timeline.enter(1, "down", 2.0)  # killed during its first start-up
    timeline.enter(1, "starting", 4.0)
    timeline.enter(1, "training", 9.0)  # still its first time to train: a start-up of 5 s
    timeline.enter(2, "starting", 0.0)  # cut short by the end of the run
    timeline.close(20.0)
    first, later = launch_durations(timeline.intervals)
    assert sorted(first) == [4.0, 5.0]
    assert later == [3.0]
