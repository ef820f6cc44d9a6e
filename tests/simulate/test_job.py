"""The simulated local job: the runner's accounting of phases, rollbacks and blocked time, under the
shared failure model."""

import pytest

from diloco.failures import Failure, FailureModel, failure_model_for, failure_schedule
from diloco.runner.timeline import goodput_of
from diloco.simulate.job import JobTiming, simulate_job

TIMING = JobTiming(restart_s=3.0, step_time_s=0.5, startup_s=4.0, checkpoint_every=10)


def phases(job, learner):  # type: ignore[no-untyped-def]
    return [(i.phase, i.start_s, i.end_s) for i in job.timeline.intervals if i.learner == learner]


def test_without_failures_only_the_start_up_is_lost() -> None:
    job = simulate_job(FailureModel(3, mtbf_s=0), TIMING, time_limit_s=100, max_steps=10**6)
    g = goodput_of(job.timeline)
    assert phases(job, 0) == [("starting", 0.0, 4.0), ("training", 4.0, 100.0)]
    assert g.startup_s == pytest.approx(12.0)
    assert g.goodput == pytest.approx(96 / 100)
    assert g.steady_goodput == pytest.approx(1.0)
    assert job.steps == [192, 192, 192]


def test_a_failure_costs_the_repair_the_restart_and_the_steps_since_the_checkpoint() -> None:
    # learner 0 fails at 22.5 s: 37 steps after its start-up at 4 s, checkpoint at step 30
    model = FailureModel(2, mtbf_s=60, repair_s=2.0)
    job = simulate_job(model, TIMING, time_limit_s=50, max_steps=10**6, failures=[Failure(22.5, 0)])
    assert phases(job, 0) == [("starting", 0.0, 4.0), ("training", 4.0, 22.5), ("down", 22.5, 24.5),
                              ("starting", 24.5, 27.5), ("training", 27.5, 50.0)]  # fmt: skip
    assert phases(job, 1) == [("starting", 0.0, 4.0), ("training", 4.0, 50.0)]
    (rollback,) = job.timeline.rollbacks
    assert (rollback.from_step, rollback.to_step, rollback.lost_s) == (37, 30, pytest.approx(3.5))
    assert job.steps[0] == 30 + 45  # from its checkpoint, 22.5 s of training at 2 steps/s
    g = goodput_of(job.timeline)
    assert g.useful_s == pytest.approx(46 + 18.5 + 22.5 - 3.5)


def test_instants_that_find_a_learner_down_are_absorbed_and_the_draw_is_the_runners() -> None:
    model = FailureModel(1, mtbf_s=60, repair_s=5.0)
    job = simulate_job(model, TIMING, time_limit_s=50, max_steps=10**6,
                       failures=[Failure(10.0, 0), Failure(12.0, 0), Failure(16.0, 0)])  # fmt: skip
    assert (job.kills, job.absorbed) == (2, 1)  # 12 s: down; 16 s: starting again, so killed
    drawn = failure_model_for("decoupled", learners=4, mtbf_s=20, repair_s=1, seed=3)
    job = simulate_job(drawn, TIMING, time_limit_s=200, max_steps=10**6)
    assert job.kills + job.absorbed == len(failure_schedule(drawn, 200))


def test_a_failure_of_one_rank_takes_the_whole_data_parallel_unit_down() -> None:
    model = failure_model_for("ddp", learners=3, mtbf_s=60, repair_s=2.0, seed=0)
    job = simulate_job(model, TIMING, time_limit_s=50, max_steps=10**6, failures=[Failure(22.5, 2)])
    assert phases(job, 0) == phases(job, 1) == phases(job, 2)
    assert [r.learner for r in job.timeline.rollbacks] == [0, 1, 2]
    assert goodput_of(job.timeline).blocked_s == 0


def test_with_a_quorum_of_all_the_others_are_blocked_until_the_failed_learner_trains_again() -> None:
    model = failure_model_for("diloco-sync", learners=2, mtbf_s=60, repair_s=2.0, seed=0)
    job = simulate_job(model, TIMING, time_limit_s=50, max_steps=10**6, failures=[Failure(22.5, 0)])
    g = goodput_of(job.timeline)
    assert g.blocked_s == pytest.approx(27.5 - 22.5)  # learner 1, from the failure to learner 0's return
    assert job.steps[1] == 37 + 45  # it made no progress while blocked


def test_the_measured_share_of_syncing_is_blocked_and_slows_progress() -> None:
    timing = JobTiming(restart_s=3.0, step_time_s=0.5, startup_s=0.0, blocked_fraction=0.2)
    job = simulate_job(FailureModel(2, mtbf_s=0), timing, time_limit_s=100, max_steps=10**6)
    g = goodput_of(job.timeline)
    assert g.blocked_s == pytest.approx(40.0)
    assert g.goodput == pytest.approx(0.8)
    assert job.steps == [160, 160]


def test_learners_that_reach_max_steps_leave_and_the_job_ends() -> None:
    job = simulate_job(FailureModel(2, mtbf_s=0), TIMING, time_limit_s=100, max_steps=20)
    assert phases(job, 0) == [("starting", 0.0, 4.0), ("training", 4.0, 14.0)]
    assert job.steps == [20, 20]


def test_impossible_timings_are_refused() -> None:
    with pytest.raises(ValueError, match="step"):
        JobTiming(restart_s=1.0, step_time_s=0.0)
    with pytest.raises(ValueError, match="blocked fraction"):
        JobTiming(restart_s=1.0, step_time_s=0.1, blocked_fraction=1.0)
    with pytest.raises(ValueError, match="time limit"):
        simulate_job(FailureModel(1), TIMING, time_limit_s=0, max_steps=1)
