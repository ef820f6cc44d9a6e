"""The round's checks: a contribution that fails them is excluded with a reason and the others
merge; the norm checks follow the fragment's recent rounds."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from diloco_core.codec import CorruptPayload
from diloco_core.config import DiLoCoSettings
from diloco_core.fragments import build_plan
from diloco_core.outer import OuterState
from diloco_core.screening import MIN_HISTORY, NormHistory, screened_round, tensors_norm

PLAN = build_plan([("w", (4,))], 1, 4, 1)
SPEC = PLAN.fragments[0]
PARAMS = {"w": np.zeros(4, np.float32)}


@dataclass(frozen=True)
class Delta:
    name: str
    tensors: dict[str, np.ndarray]
    base_version: int = 0
    steps: int = 4
    tokens: int = 32


def delta(name: str, value: float) -> Delta:
    return Delta(name, {"w": np.full(4, value, np.float32)})


def settings(**kw: object) -> DiLoCoSettings:
    return DiLoCoSettings.model_validate(
        {"fragments": 1, "inner_steps": 4, "overlap": 1, "merge_rule": "mean", **kw}
    )


def history(norm: float, rounds: int = MIN_HISTORY) -> NormHistory:
    h = NormHistory()
    for _ in range(rounds):
        h = h.after([norm, norm], norm)
    return h


def test_a_contribution_far_beyond_the_parameters_is_excluded_before_any_history() -> None:
    ones = {"w": np.ones(4, np.float32)}  # norm 2: at most 20 with the default factor 10
    good, huge = delta("good", 0.5), delta("huge", 3e38)
    screened = screened_round(SPEC, ones, OuterState(), 0, [huge, good], settings(), NormHistory())
    assert screened.result is not None
    assert [c.name for c in screened.merged] == ["good"]
    ((excluded, reason),) = screened.excluded
    assert excluded.name == "huge"
    assert "above the limit 20 for 4 steps (max_update_norm_factor 10)" in reason


def test_values_whose_sums_overflow_are_excluded_and_the_others_merge() -> None:
    good, huge = delta("good", 0.5), delta("huge", 3e38)  # parameters all zero: no norm bound yet
    screened = screened_round(
        SPEC, PARAMS, OuterState(), 0, [huge, good, huge], settings(merge_rule="rda"), NormHistory()
    )
    assert screened.result is not None
    assert [c.name for c in screened.merged] == ["good"]
    assert [c.name for c, _ in screened.excluded] == ["huge", "huge"]
    assert all("excluded as the largest contribution" in reason for _, reason in screened.excluded)
    assert np.isfinite(screened.result.params["w"]).all()


def test_a_contribution_whose_claims_cannot_be_weighed_is_excluded_alone() -> None:
    """Claims beyond the bounds (a sum of continuations, say) exclude exactly that contribution, even
    when the honest ones have larger norms (the largest-norm retry would have dropped them first)."""
    honest = [
        Delta("honest-1", {"w": np.full(4, 0.5, np.float32)}),
        Delta("honest-2", {"w": np.full(4, 0.4, np.float32)}),
    ]
    claims = Delta("claims", {"w": np.full(4, 0.01, np.float32)}, steps=2 * 10**8, tokens=2 * 10**17)
    screened = screened_round(SPEC, PARAMS, OuterState(), 0, [*honest, claims], settings(), NormHistory())
    assert screened.result is not None
    assert [c.name for c in screened.merged] == ["honest-1", "honest-2"]
    ((excluded, reason),) = screened.excluded
    assert excluded.name == "claims"
    assert reason.startswith("its weight cannot be computed: tokens (200000000000000000)")


def test_nothing_is_merged_when_every_contribution_fails() -> None:
    bad = Delta("nan", {"w": np.array([np.nan, 0, 0, 0], np.float32)})
    screened = screened_round(SPEC, PARAMS, OuterState(), 0, [bad], settings(), NormHistory())
    assert screened.result is None
    assert screened.merged == ()
    assert screened.excluded == ((bad, "non-finite values in 'w'"),)


def test_a_norm_far_above_the_recent_rounds_is_excluded_once_there_is_a_history() -> None:
    big, usual = delta("big", 100.0), delta("usual", 1.0)
    usual_norm = tensors_norm(usual.tensors)
    # too few norms known yet (none before, two in the round) and parameters all zero: no bound
    few = screened_round(SPEC, PARAMS, OuterState(), 0, [big, usual], settings(), NormHistory())
    assert len(few.merged) == 2
    screened = screened_round(SPEC, PARAMS, OuterState(), 0, [big, usual], settings(), history(usual_norm))
    assert [c.name for c in screened.merged] == ["usual"]
    ((excluded, reason),) = screened.excluded
    assert excluded.name == "big"
    assert "max_update_norm_factor 10" in reason
    # factor 0: no norm check
    off = screened_round(
        SPEC, PARAMS, OuterState(), 0, [big, usual], settings(max_update_norm_factor=0), history(usual_norm)
    )
    assert len(off.merged) == 2


def test_the_norm_history_keeps_the_newest_rounds() -> None:
    h = NormHistory()
    assert h.limit(h.updates, 10.0) == math.inf
    for i in range(40):
        h = h.after([float(i)], float(i))
    assert len(h.updates) == 16
    assert h.updates[-1] == 39.0
    assert h.limit(h.updates, 2.0) == 2.0 * 31.0  # the lower median of 24..39


def test_a_learner_with_half_the_norms_cannot_ratchet_the_limit_up() -> None:
    """One honest learner (norm 1) and one that sends at the limit every round: the limit stays at
    factor x the honest norm over 200 rounds (with the median it grew 1.22x a round)."""
    h = history(1.0)
    for _ in range(200):
        attacker = h.limit((*h.contributions, 1.0), 10.0)
        h = h.after([1.0, attacker], 1.0)
    assert h.limit(h.contributions, 10.0) == 10.0


def test_a_few_step_contribution_and_a_whole_one_compare_per_square_root_of_their_steps() -> None:
    """Partial contributions (1 step) in the history do not make a whole one (H = 4 steps, twice the
    norm) look large, and claiming more steps than H buys no larger limit."""
    one_step = NormHistory(contributions=(1.0,) * 8, updates=(2.0,) * 8)
    whole = Delta("whole", {"w": np.full(4, 9.0, np.float32)}, steps=4)  # norm 18 = 9 per sqrt(step)
    screened = screened_round(SPEC, PARAMS, OuterState(), 0, [whole], settings(), one_step)
    assert [c.name for c in screened.merged] == ["whole"]  # within 10 x 1 x sqrt(4) = 20
    claims = Delta("claims", {"w": np.full(4, 12.0, np.float32)}, steps=10**6, tokens=10**6)  # norm 24
    screened = screened_round(SPEC, PARAMS, OuterState(), 0, [claims], settings(), one_step)
    assert "above the limit 20 for 1000000 steps" in screened.excluded[0][1]


def test_without_a_history_the_limit_is_fixed_at_the_first_rounds_parameters() -> None:
    """Before MIN_HISTORY norms are known, the bound is the reference norm taken at the first
    checked round, not the current parameters' norm, so the first rounds cannot compound it."""
    ones = {"w": np.ones(4, np.float32)}  # norm 2: the reference, a limit of 20
    first = screened_round(SPEC, ones, OuterState(), 0, [delta("a", 9.0)], settings(), NormHistory())
    assert first.result is not None
    assert first.history.reference == 2.0
    grown = {"w": np.full(4, 10.0, np.float32)}  # norm 20: a limit of 200 if it followed the parameters
    second = screened_round(SPEC, grown, OuterState(), 1, [delta("b", 50.0)], settings(), first.history)
    assert second.result is None
    assert "above the limit 20 " in second.excluded[0][1]


class Unreadable(dict[str, np.ndarray]):
    """Tensors read from a payload only when the round asks, one of them malformed."""

    def __getitem__(self, name: str) -> np.ndarray:
        raise CorruptPayload(f"tensor {name!r}: topk index 16 is outside its block")


def test_a_contribution_whose_tensors_cannot_be_read_is_excluded_and_the_others_merge() -> None:
    bad = Delta("bad", Unreadable(w=np.zeros(4, np.float32)))
    good = delta("good", 0.5)
    screened = screened_round(SPEC, PARAMS, OuterState(), 0, [bad, good], settings(), NormHistory())
    assert screened.result is not None
    assert [c.name for c in screened.merged] == ["good"]
    assert [(c.name, "cannot be read" in why) for c, why in screened.excluded] == [("bad", True)]


@pytest.mark.xfail(
    strict=True,
    reason="known defect (docs/algorithm.md 3.7): a lagging learner's parts of one step, small in its "
    "learning-rate warm-up, are the lower median of a two-learner job and the other learner's whole "
    "contributions are excluded from every round; seen live with one learner 20x slower",
)
def test_a_slow_learners_few_step_parts_do_not_shut_out_the_others() -> None:
    """An honest learner that lags (a loaded machine, a late start) is asked for its progress early
    and sends parts of 1 step, small while its learning rate warms up; the other sends whole
    contributions. Over 12 rounds both should merge in every round."""
    ones = {"w": np.ones(4, np.float32)}  # norm 2
    s, h = settings(), NormHistory()
    for version in range(12):
        whole = Delta("fast", {"w": np.full(4, 0.5, np.float32)}, version, steps=4, tokens=32)
        part = Delta(
            "slow", {"w": np.full(4, 0.0125, np.float32)}, version, steps=1, tokens=8
        )  # 1/20 per step
        screened = screened_round(SPEC, ones, OuterState(), version, [whole, part], s, h)
        assert screened.result is not None, version
        assert sorted(c.name for c in screened.merged) == ["fast", "slow"], (version, screened.excluded)
        h = screened.history.after(screened.norms, screened.update_norm)
