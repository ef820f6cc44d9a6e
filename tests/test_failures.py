"""The failure model shared by `diloco run` and `diloco simulate run`: the draw of failure instants,
what a failure takes down in each mode, and the shared flags."""

import argparse
import statistics
from itertools import pairwise

import pytest

from diloco.failures import (
    Failure,
    FailureModel,
    add_failure_flags,
    failure_model_for,
    failure_schedule,
    failure_times,
)


def test_same_seed_same_instants_and_another_seed_differs() -> None:
    a = failure_schedule(FailureModel(3, mtbf_s=10, seed=1), 100)
    assert a == failure_schedule(FailureModel(3, mtbf_s=10, seed=1), 100)
    assert a != failure_schedule(FailureModel(3, mtbf_s=10, seed=2), 100)


def test_the_instants_do_not_depend_on_repair_mode_or_the_other_learners() -> None:
    decoupled = failure_model_for("decoupled", learners=4, mtbf_s=10, repair_s=1, seed=5)
    ddp = failure_model_for("ddp", learners=8, mtbf_s=10, repair_s=30, seed=5)
    for learner in range(4):
        assert failure_times(decoupled, learner, 200) == failure_times(ddp, learner, 200)


def test_a_longer_horizon_extends_the_same_instants() -> None:
    model = FailureModel(1, mtbf_s=5, seed=3)
    short, long = failure_times(model, 0, 50), failure_times(model, 0, 500)
    assert long[: len(short)] == short
    assert all(t >= 50 for t in long[len(short) :])


def test_time_between_instants_is_exponential_with_the_given_mean() -> None:
    times = failure_times(FailureModel(1, mtbf_s=10, seed=7), 0, 100_000)
    gaps = [b - a for a, b in pairwise(times)]
    assert statistics.mean(gaps) == pytest.approx(10, rel=0.05)
    # exponential: the standard deviation equals the mean (a constant gap would give 0)
    assert statistics.stdev(gaps) == pytest.approx(10, rel=0.1)


def test_the_schedule_is_every_learners_instants_in_time_order() -> None:
    model = FailureModel(3, mtbf_s=4, seed=0)
    schedule = failure_schedule(model, 60)
    assert list(schedule) == sorted(schedule)
    for learner in range(3):
        assert tuple(f.at_s for f in schedule if f.learner == learner) == failure_times(model, learner, 60)
    assert all(isinstance(f, Failure) and 0 <= f.at_s < 60 for f in schedule)


def test_each_mode_meets_a_failure_its_own_way() -> None:
    def model(mode: str) -> FailureModel:
        return failure_model_for(mode, learners=4, mtbf_s=60, repair_s=2, seed=0)

    assert (model("decoupled").elastic, model("decoupled").quorum) == (True, 1)
    assert (model("diloco-sync").elastic, model("diloco-sync").quorum) == (True, 4)
    assert (model("ddp").elastic, model("ddp").quorum) == (False, 4)
    assert model("decoupled").group_of(2) == (2,)
    assert model("ddp").group_of(2) == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="unknown mode"):
        model("elastic")


def test_no_failures_at_zero_mtbf_and_bad_settings_are_refused() -> None:
    assert failure_schedule(FailureModel(2, mtbf_s=0), 100) == ()
    with pytest.raises(ValueError, match="repair"):
        FailureModel(1, repair_s=-1)
    with pytest.raises(ValueError, match="quorum"):
        FailureModel(2, quorum=3)
    with pytest.raises(ValueError, match="learner"):
        FailureModel(0)
    with pytest.raises(ValueError, match="horizon"):
        failure_times(FailureModel(1), 0, -1)


def test_the_shared_flags_parse_into_the_model() -> None:
    parser = argparse.ArgumentParser()
    add_failure_flags(parser, mtbf_s=60, repair_s=8, seed=0)
    args = parser.parse_args(["--mtbf", "30", "--repair", "2.5", "--seed", "4"])
    assert (args.mtbf, args.repair, args.seed) == (30.0, 2.5, 4)
    defaults = parser.parse_args([])
    assert (defaults.mtbf, defaults.repair, defaults.seed) == (60.0, 8.0, 0)
