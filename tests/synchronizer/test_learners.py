"""The learner registry's bookkeeping: liveness, step time, unknown learners and the token counter's baseline."""

from __future__ import annotations

import pytest
from diloco_core.bounds import MAX_STEP_TIME_S
from diloco_core.layout import LearnerRecord, LearnerRegistryRecord
from diloco_core.protocol import Heartbeat
from diloco_sync.learners import (
    LearnerLeft,
    LearnerRegistry,
    UnknownLearner,
    plausible_step_time,
    step_time_ema,
    token_increment,
)


def _hb(tokens: int, **extra: object) -> Heartbeat:
    return Heartbeat.model_validate({"step": tokens // 8, "tokens": tokens, "step_time_s": 0.1, **extra})


def test_token_increment_counts_growth_and_only_rebases_otherwise() -> None:
    assert token_increment(0, 80) == 80
    assert token_increment(80, 80) == 0
    assert token_increment(80, 200) == 120
    assert token_increment(None, 5000) == 0  # unknown baseline: the first report only sets it
    assert token_increment(200, 40) == 0  # resumed from an older checkpoint


def test_heartbeat_of_an_unknown_learner_raises_unknown_learner() -> None:
    reg = LearnerRegistry(heartbeat_timeout_s=10)
    with pytest.raises(UnknownLearner):
        reg.heartbeat("ghost", _hb(8), now=1.0)
    with pytest.raises(UnknownLearner):
        reg.leave("ghost", now=1.0)
    assert reg.learners == {}


def test_new_learner_counts_from_zero_and_resumed_or_restored_ones_from_their_first_report() -> None:
    reg = LearnerRegistry(heartbeat_timeout_s=10)
    reg.register(LearnerRecord(learner_id="fresh"), step=0, now=0.0)
    reg.register(LearnerRecord(learner_id="resumed"), step=500, now=0.0)
    assert reg.heartbeat("fresh", _hb(64), now=1.0) == 64
    assert reg.heartbeat("fresh", _hb(96), now=2.0) == 32
    assert reg.heartbeat("resumed", _hb(4000), now=1.0) == 0
    assert reg.heartbeat("resumed", _hb(4040), now=2.0) == 40

    restarted = LearnerRegistry(heartbeat_timeout_s=10)
    restarted.restore(LearnerRegistryRecord(learners={"fresh": LearnerRecord(learner_id="fresh")}), now=5.0)
    assert restarted.heartbeat("fresh", _hb(96), now=6.0) == 0  # not counted twice after a restart
    assert restarted.heartbeat("fresh", _hb(104, eval_loss=2.5), now=7.0) == 8
    assert restarted.learners["fresh"].eval_loss == 2.5


def test_a_learner_that_left_stays_left_after_a_restart_until_it_registers_again() -> None:
    reg = LearnerRegistry(heartbeat_timeout_s=10)
    reg.register(LearnerRecord(learner_id="a"), step=0, now=0.0)
    reg.register(LearnerRecord(learner_id="b"), step=0, now=0.0)
    assert reg.leave("a", now=1.0) is True  # the durable record changed: save it
    assert reg.leave("a", now=2.0) is False

    restarted = LearnerRegistry(heartbeat_timeout_s=10)
    restarted.restore(reg.to_record(), now=50.0)
    states = {s.learner_id: (s.state, s.alive) for s in restarted.status(51.0, versions={})}
    assert states == {"a": ("left", False), "b": ("training", True)}
    assert restarted.alive_count(51.0) == 1

    assert restarted.register(LearnerRecord(learner_id="a"), step=7, now=52.0) is True
    assert restarted.alive_count(52.0) == 2
    assert restarted.to_record().learners["a"].left is False


def test_a_learner_that_left_cannot_heartbeat_itself_back_until_it_registers() -> None:
    reg = LearnerRegistry(heartbeat_timeout_s=10)
    reg.register(LearnerRecord(learner_id="a"), step=0, now=0.0)
    reg.leave("a", now=1.0)
    with pytest.raises(LearnerLeft):
        reg.heartbeat("a", _hb(8), now=2.0)
    assert reg.alive_count(2.0) == 0
    restarted = LearnerRegistry(heartbeat_timeout_s=10)
    restarted.restore(reg.to_record(), now=5.0)
    with pytest.raises(LearnerLeft):
        restarted.heartbeat("a", _hb(8), now=6.0)
    restarted.register(LearnerRecord(learner_id="a"), step=1, now=7.0)
    assert restarted.heartbeat("a", _hb(16), now=8.0) == 0
    assert restarted.alive_count(8.0) == 1


@pytest.mark.parametrize("reported", [float("inf"), float("nan"), -1.0, 0.0, 1e300, MAX_STEP_TIME_S * 2])
def test_the_step_time_ema_ignores_reports_beyond_the_bound(reported: float) -> None:
    assert step_time_ema(0.5, reported) == 0.5
    assert step_time_ema(0.0, reported) == 0.0
    assert step_time_ema(0.5, MAX_STEP_TIME_S) <= MAX_STEP_TIME_S


def test_a_finished_learner_keeps_its_final_step_and_tokens_across_a_restart() -> None:
    """The job's step budget and token count read these: a restart must not reset them to 0."""
    reg = LearnerRegistry(heartbeat_timeout_s=10)
    reg.register(LearnerRecord(learner_id="a"), step=0, now=0.0)
    reg.heartbeat("a", _hb(800), now=1.0)  # step 100
    assert reg.leave("a", now=2.0) is True
    assert (reg.to_record().learners["a"].step, reg.to_record().learners["a"].tokens) == (100, 800)

    restarted = LearnerRegistry(heartbeat_timeout_s=10)
    restarted.restore(reg.to_record(), now=50.0)
    (a,) = restarted.status(51.0, versions={})
    assert (a.state, a.step, a.tokens) == ("left", 100, 800)
    with pytest.raises(LearnerLeft):  # it left: it must register again before it reports
        restarted.heartbeat("a", _hb(800), now=52.0)


def test_leaving_again_further_on_updates_the_stored_final_progress() -> None:
    reg = LearnerRegistry(heartbeat_timeout_s=10)
    reg.register(LearnerRecord(learner_id="a"), step=0, now=0.0)
    reg.heartbeat("a", _hb(80), now=1.0)
    assert reg.leave("a", now=2.0) is True
    reg.register(LearnerRecord(learner_id="a"), step=10, now=3.0)
    reg.heartbeat("a", _hb(160), now=4.0)
    assert reg.leave("a", now=5.0) is True
    assert reg.leave("a", now=6.0) is False
    assert reg.to_record().learners["a"].step == 20


def test_liveness_is_a_function_of_time() -> None:
    reg = LearnerRegistry(heartbeat_timeout_s=10)
    reg.register(LearnerRecord(learner_id="a"), step=0, now=100.0)
    reg.register(LearnerRecord(learner_id="b"), step=0, now=100.0)
    reg.heartbeat("b", Heartbeat(step=5, tokens=40, step_time_s=0.2), now=108.0)
    assert reg.alive_count(105.0) == 2
    assert reg.alive_count(111.0) == 1  # a timed out, b heard at 108
    status = {s.learner_id: s for s in reg.status(111.0, versions={})}
    assert status["a"].state == "dead"
    assert not status["a"].alive
    assert status["b"].state == "training"
    assert status["b"].step == 5
    assert reg.step_time(111.0) == 0.2  # only alive learners count
    reg.leave("b", 112.0)
    assert reg.alive_count(112.0) == 0
    assert reg.step_time(112.0) == 0.0


def test_the_grace_window_uses_an_ema_of_the_reported_step_times() -> None:
    assert step_time_ema(0.0, 2.0) == 2.0
    assert step_time_ema(2.0, 0.0) == 2.0  # a heartbeat without a step time changes nothing
    assert step_time_ema(2.0, 4.0, weight=0.25) == pytest.approx(2.5)


def test_one_learner_cannot_stretch_the_grace_window_with_long_step_times() -> None:
    """A learner reporting a day per step: among two it is not the median, and while its own step
    counter advances, its report is held to the pace its heartbeats show."""
    reg = LearnerRegistry(heartbeat_timeout_s=60)
    for name in ("honest", "liar"):
        reg.register(LearnerRecord(learner_id=name), step=0, now=100.0)
    reg.heartbeat("honest", Heartbeat(step=10, tokens=80, step_time_s=0.5), now=105.0)
    reg.heartbeat("liar", Heartbeat(step=0, tokens=0, step_time_s=MAX_STEP_TIME_S), now=105.0)
    assert reg.step_time(105.0) == 0.5
    reg.heartbeat("liar", Heartbeat(step=5, tokens=40, step_time_s=MAX_STEP_TIME_S), now=110.0)
    assert reg.learners["liar"].step_time_s < MAX_STEP_TIME_S  # 5 steps in 5 s: at most 1 s each
    assert plausible_step_time(MAX_STEP_TIME_S, 5, 5.0) == 1.0
    assert plausible_step_time(0.2, 5, 5.0) == 0.2  # an honest report is shorter than its pace
    assert plausible_step_time(3.0, 0, 5.0) == 3.0  # no step taken: nothing to compare with
