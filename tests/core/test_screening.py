"""The round's checks: a contribution that cannot be merged is excluded with a reason and the others
merge; one above the norm limit is merged scaled down to it, and so is a merged update; the limits
follow the fragment's recent rounds."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from diloco_core import codec
from diloco_core.codec import CorruptPayload
from diloco_core.config import DiLoCoSettings
from diloco_core.fragments import build_plan
from diloco_core.outer import OuterState
from diloco_core.quantized_arrays import QuantizedArrays
from diloco_core.screening import FLOOR, MIN_HISTORY, NormHistory, screened_round, tensors_norm

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


def test_a_contribution_far_beyond_the_parameters_is_clipped_before_any_history() -> None:
    ones = {"w": np.ones(4, np.float32)}  # norm 2: at most 20 with the default factor 10
    good, huge = delta("good", 0.5), delta("huge", 3e38)
    screened = screened_round(SPEC, ones, OuterState(), 0, [huge, good], settings(), NormHistory())
    assert screened.result is not None
    assert [c.name for c in screened.merged] == ["huge", "good"]
    assert screened.excluded == ()
    ((clipped, reason),) = screened.clipped
    assert clipped.name == "huge"
    assert "above the limit 20 for 4 steps (max_update_norm_factor 10); merged at the limit" in reason
    # the mean of the clipped one (10 a value, norm 20) and the good one (0.5 a value)
    np.testing.assert_allclose(screened.result.update["w"], np.full(4, 5.25), rtol=1e-6)
    assert screened.norms == pytest.approx((10.0, 0.5))  # as merged, per square root of 4 steps


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


def test_a_norm_far_above_the_recent_rounds_is_clipped_once_there_is_a_history() -> None:
    big, usual = delta("big", 100.0), delta("usual", 1.0)
    usual_norm = tensors_norm(usual.tensors)  # 2, 1 per square root of its 4 steps
    # too few norms known yet (none before, two in the round) and parameters all zero: no bound
    few = screened_round(SPEC, PARAMS, OuterState(), 0, [big, usual], settings(), NormHistory())
    assert (len(few.merged), few.clipped) == (2, ())
    screened = screened_round(
        SPEC, PARAMS, OuterState(), 0, [big, usual], settings(), history(usual_norm / 2)
    )
    assert [c.name for c in screened.merged] == ["big", "usual"]
    ((clipped, reason),) = screened.clipped
    assert clipped.name == "big"
    assert "norm 200 is above the limit 20 for 4 steps (max_update_norm_factor 10)" in reason
    assert screened.result is not None
    # their mean, (20 + 2) / 2, is above 10 x the recent updates' 1: taken at 10
    assert screened.update_clipped is not None
    assert "norm 11 is above the limit 10 " in screened.update_clipped
    assert tensors_norm(screened.result.update) == pytest.approx(10.0, rel=1e-6)
    # factor 0: no norm check
    off = screened_round(
        SPEC, PARAMS, OuterState(), 0, [big, usual], settings(max_update_norm_factor=0), history(usual_norm)
    )
    assert (len(off.merged), off.clipped, off.update_clipped) == (2, (), None)


def test_a_merged_update_above_the_recent_updates_is_scaled_down_to_its_limit() -> None:
    """Each contribution within its limit, their merge above the updates' (10 x 0.5): the outer
    step takes the merged update scaled down to 5, and the history records it so."""
    recent = NormHistory(contributions=(1.0,) * 8, updates=(0.5,) * 8)
    whole = Delta("whole", {"w": np.full(4, 9.0, np.float32)})  # norm 18: within 10 x 1 x sqrt(4)
    screened = screened_round(SPEC, PARAMS, OuterState(), 0, [whole], settings(), recent)
    assert screened.result is not None
    assert (screened.clipped, screened.excluded) == ((), ())
    assert screened.update_clipped is not None
    assert (
        "norm 18 is above the limit 5 (max_update_norm_factor 10); taken at the limit"
        in screened.update_clipped
    )
    assert screened.update_norm == pytest.approx(5.0)
    assert tensors_norm(screened.result.update) == pytest.approx(5.0, rel=1e-6)
    unbounded = screened_round(
        SPEC, PARAMS, OuterState(), 0, [whole], settings(max_update_norm_factor=0), recent
    )
    assert unbounded.result is not None
    np.testing.assert_allclose(screened.result.params["w"], unbounded.result.params["w"] * 5 / 18, rtol=1e-6)
    assert screened.next_history().updates[-1] == pytest.approx(5.0)


def test_one_learner_at_any_norm_moves_the_model_by_at_most_the_limit_round_after_round() -> None:
    """An honest learner (norm 1) and one that sends a million times it every round, over 40 rounds:
    every round merges both, the other's clipped: to 10 x the parameters' norm in the first round,
    then to 10 x the honest norm (the lower median), and the limit does not grow."""
    ones = {"w": np.ones(4, np.float32)}
    s, h, params, outer = settings(outer_lr=1.0, outer_momentum=0.0), NormHistory(), ones, OuterState()
    for version in range(40):
        honest, big = delta("honest", 0.5), delta("big", 5e5)
        screened = screened_round(SPEC, params, outer, version, [honest, big], s, h)
        assert screened.result is not None
        assert [c.name for c in screened.merged] == ["honest", "big"]
        assert [c.name for c, _ in screened.clipped] == ["big"]
        # the mean of the honest 1 and the other's 20 (first round), then 10
        assert screened.update_norm == pytest.approx(10.5 if version == 0 else 5.5, rel=1e-6), version
        params, outer, h = screened.result.params, screened.result.outer, screened.next_history()
    assert h.limit(h.contributions, 10.0) == pytest.approx(5.0)  # 10 x the honest 0.5 per sqrt(step)
    assert h.limit(h.updates, 10.0) == pytest.approx(55.0)  # 10 x the rounds' 5.5: no compounding


def test_a_learner_that_sends_zeros_cannot_freeze_the_fragment() -> None:
    """In a job of two, zeros every round are the lower median; the limit counts it as at least
    FLOOR x the reference norm, so the honest learner is still merged (clipped) in every round."""
    ones = {"w": np.ones(4, np.float32)}  # the reference norm: 2
    s, h, params, outer = settings(outer_lr=1.0, outer_momentum=0.0), NormHistory(), ones, OuterState()
    floor = 10.0 * FLOOR * 2.0  # per square root of a step
    for version in range(16):
        honest, zeros = delta("honest", 0.5), delta("zeros", 0.0)
        screened = screened_round(SPEC, params, outer, version, [honest, zeros], s, h)
        assert screened.result is not None
        assert screened.update_norm > 0, version
        params, outer, h = screened.result.params, screened.result.outer, screened.next_history()
    assert h.limit(h.contributions, 10.0) == pytest.approx(floor)
    assert screened.update_norm == pytest.approx(floor * 2 / 2, rel=1e-5)  # the honest at 2 x floor, halved


def test_a_contribution_is_clipped_alike_under_rda_and_from_its_quantized_payload() -> None:
    """RDA takes the clipped norm as the contribution's radius; a payload decoded lazily from int8
    codes is clipped as its values are (scaled as each tensor is read)."""
    ones = {"w": np.ones(4, np.float32)}  # a limit of 20 before any history
    good, huge = delta("good", 0.5), delta("huge", 3e38)
    screened = screened_round(
        SPEC, ones, OuterState(), 0, [huge, good], settings(merge_rule="rda"), NormHistory()
    )
    assert screened.result is not None
    assert tensors_norm(screened.result.update) == pytest.approx(
        10.5, rel=1e-6
    )  # (20 + 1) / 2, one direction
    blob = codec.encode(
        {"w": np.full(4, 100.0, np.float32)}, fragment=0, base_version=0, kind="outer_grad", quantizer="int8"
    )
    payload = codec.decode_quantized(blob, fragment=SPEC)
    assert isinstance(payload.tensors, QuantizedArrays)
    lazy = Delta("lazy", payload.tensors)
    screened = screened_round(SPEC, ones, OuterState(), 0, [lazy, good], settings(), NormHistory())
    assert screened.result is not None
    assert [c.name for c, _ in screened.clipped] == ["lazy"]
    np.testing.assert_allclose(screened.result.update["w"], np.full(4, 5.25), rtol=1e-5)


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
    assert "above the limit 20 for 1000000 steps" in screened.clipped[0][1]


def test_without_a_history_the_limit_is_fixed_at_the_first_rounds_parameters() -> None:
    """Before MIN_HISTORY norms are known, the bound is the reference norm taken at the first
    checked round, not the current parameters' norm, so the first rounds cannot compound it."""
    ones = {"w": np.ones(4, np.float32)}  # norm 2: the reference, a limit of 20
    first = screened_round(SPEC, ones, OuterState(), 0, [delta("a", 9.0)], settings(), NormHistory())
    assert first.result is not None
    assert first.history.reference == 2.0
    grown = {"w": np.full(4, 10.0, np.float32)}  # norm 20: a limit of 200 if it followed the parameters
    second = screened_round(SPEC, grown, OuterState(), 1, [delta("b", 50.0)], settings(), first.history)
    assert second.result is not None
    assert "above the limit 20 " in second.clipped[0][1]
    assert second.update_norm == pytest.approx(20.0, rel=1e-6)


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


def test_a_slow_learners_few_step_parts_do_not_shut_out_the_others() -> None:
    """An honest learner that lags (a loaded machine, a late start) is asked for its progress early
    and sends parts of 1 step, small while its learning rate warms up; the other sends whole
    contributions. Over 12 rounds both merge in every round: the whole ones clipped to the limit the
    small parts set, never excluded (excluded, they were left out of every round)."""
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
        assert screened.excluded == ()
        h = screened.next_history()
    # 10 x the part's 0.025 per step, times sqrt(4): the whole one (norm 1) merged at half its norm
    assert [c.name for c, _ in screened.clipped] == ["fast"]
    assert "norm 1 is above the limit 0.5 for 4 steps" in screened.clipped[0][1]


PAIR = build_plan([("w", (4,)), ("v", (3,))], 1, 4, 1).fragments[0]
PAIR_PARAMS = {"w": np.ones(4, np.float32), "v": np.ones(3, np.float32)}


class Counted(dict[str, np.ndarray]):
    """Tensors that count how often the round reads them (a learner's folded parts are added up
    on each reading), each read as a fresh array."""

    reads = 0

    def __getitem__(self, name: str) -> np.ndarray:
        self.reads += 1
        return super().__getitem__(name).copy()


@dataclass(frozen=True)
class Carried(Delta):
    """A contribution with its norm measured on arrival."""

    norm: float | None = None


def pair(name: str, w: float, v: float) -> Delta:
    return Delta(name, Counted(w=np.full(4, w, np.float32), v=np.linspace(-v, v, 3, dtype=np.float32)))


def carried(d: Delta) -> Carried:
    tensors = {name: np.array(a) for name, a in d.tensors.items()}
    return Carried(d.name, tensors, norm=tensors_norm(tensors))


@pytest.mark.parametrize("rule", ["mean", "rda"])
def test_a_contribution_without_a_norm_is_read_once_and_merged_as_with_its_norm(rule: str) -> None:
    """Folded parts carry no norm: the round measures it as its merge reads the tensors, so each is
    read once, and the round is bit for bit the one merged from contributions carrying their norms."""
    s = settings(merge_rule=rule)
    folded = [pair("a", 0.5, 0.25), pair("b", 0.25, 1.0)]
    known = [carried(d) for d in folded]
    screened = screened_round(PAIR, PAIR_PARAMS, OuterState(), 0, folded, s, NormHistory())
    expected = screened_round(PAIR, PAIR_PARAMS, OuterState(), 0, known, s, NormHistory())
    assert [d.tensors.reads for d in folded] == [2, 2]  # w and v, once each
    assert screened.result is not None
    assert expected.result is not None
    for name in ("w", "v"):
        np.testing.assert_array_equal(screened.result.params[name], expected.result.params[name])
        np.testing.assert_array_equal(screened.result.update[name], expected.result.update[name])
    assert screened.norms == expected.norms
    assert (screened.clipped, screened.excluded) == ((), ())


def test_a_contribution_without_a_norm_found_above_its_limit_is_merged_clipped_as_with_its_norm() -> None:
    """Measured in the first merge and found above its limit, it is merged again at the limit: the
    same round as when its norm was known before."""
    folded = [pair("huge", 3e3, 1e3), pair("good", 0.5, 0.25)]  # the parameters' norm sqrt(7): limit 26
    known = [carried(d) for d in folded]
    screened = screened_round(PAIR, PAIR_PARAMS, OuterState(), 0, folded, settings(), NormHistory())
    expected = screened_round(PAIR, PAIR_PARAMS, OuterState(), 0, known, settings(), NormHistory())
    assert screened.result is not None
    assert expected.result is not None
    assert [c.name for c, _ in screened.clipped] == ["huge"]
    assert [why for _, why in screened.clipped] == [why for _, why in expected.clipped]
    for name in ("w", "v"):
        np.testing.assert_array_equal(screened.result.params[name], expected.result.params[name])
    assert [d.tensors.reads for d in folded] == [4, 4]  # measured, then merged at the limit


def test_a_known_norm_certainly_above_its_limit_skips_the_measuring_merge() -> None:
    """With a history, a contribution whose norm came from arrival and is above its limit whatever
    the folded one's norm is: the round does not merge everything whole first only to drop it, so
    the known one is read once; the round is the same as with every norm known."""
    recent = history(0.5)  # limit 10 x 0.5 per square root of a step: 10 for 4 steps
    big = pair("big", 30.0, 30.0)
    known_big = Carried(big.name, big.tensors, norm=tensors_norm(dict(big.tensors.items())))
    big.tensors.reads = 0
    folded = pair("folded", 0.5, 0.25)
    screened = screened_round(PAIR, PAIR_PARAMS, OuterState(), 0, [known_big, folded], settings(), recent)
    expected = screened_round(
        PAIR, PAIR_PARAMS, OuterState(), 0, [carried(big), carried(folded)], settings(), recent
    )
    assert big.tensors.reads == 2  # w and v, by the merge at the limit only
    assert screened.result is not None
    assert expected.result is not None
    assert [c.name for c, _ in screened.clipped] == ["big"]
    for name in ("w", "v"):
        np.testing.assert_array_equal(screened.result.params[name], expected.result.params[name])
