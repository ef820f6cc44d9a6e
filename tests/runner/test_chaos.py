"""The run's chaos schedule: the shared failure model's instants over the run's time limit."""

from diloco.failures import Failure, failure_schedule
from diloco.runner.chaos import build_chaos_schedule, due_events
from diloco.runner.settings import RunSettings


def test_the_schedule_is_the_failure_models_over_the_time_limit() -> None:
    model = RunSettings().model.model_copy(update={"seed": 4})
    settings = RunSettings(mode="ddp", learners=3, mtbf_s=10, repair_s=2, model=model, time_limit_s=100)
    schedule = build_chaos_schedule(settings)
    assert schedule == failure_schedule(settings.failures, 100)
    assert schedule
    assert settings.failures.elastic is False
    assert settings.failures.repair_s == 2


def test_no_chaos_when_mtbf_is_zero() -> None:
    assert build_chaos_schedule(RunSettings(mtbf_s=0)) == ()


def test_due_events_advances_the_cursor() -> None:
    schedule = (Failure(1.0, 0), Failure(2.0, 1), Failure(3.0, 0))
    due, cursor = due_events(schedule, 0, 2.5)
    assert due == list(schedule[:2])
    assert cursor == 2
    due, cursor = due_events(schedule, cursor, 2.9)
    assert due == []
    due, cursor = due_events(schedule, cursor, 10)
    assert due == [schedule[2]]
    assert cursor == 3
