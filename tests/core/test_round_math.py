"""The round pipeline: pinned results bit for bit, inputs never edited, weights and their fallback."""

from __future__ import annotations

import os

import numpy as np
import pytest
from diloco_core import downlink
from diloco_core.config import DiLoCoSettings
from diloco_core.outer import OuterState
from diloco_core.round_math import merge_round, round_weights

from tests.core.round_cases import Given, cases, digest, load_golden, summary, write_golden


def run_cases() -> dict[str, list[dict[str, object]]]:
    """Every pinned case through ``merge_round``: per round the version, weights and digests."""
    results: dict[str, list[dict[str, object]]] = {}
    for case in cases():
        params, outer = dict(case.params), OuterState()
        out: list[dict[str, object]] = []
        for version, given in enumerate(case.rounds):
            result = merge_round(case.fragment, params, outer, version, given, case.settings)
            params, outer = result.params, result.outer
            out.append(summary(result))
        results[case.name] = out
    return results


def test_rounds_reproduce_the_pinned_results_bit_for_bit() -> None:
    results = run_cases()
    if os.environ.get("DILOCO_REGEN_GOLDEN") == "1":
        write_golden(results)
    assert results == load_golden()


def test_a_round_edits_nothing_it_is_given() -> None:
    case = cases()[2]  # Delayed Nesterov: momentum and buffer both in play
    params, outer = dict(case.params), OuterState()
    for version, given in enumerate(case.rounds[:3]):
        before = (digest(params), digest(outer.to_arrays()), [digest(g.tensors) for g in given])
        result = merge_round(case.fragment, params, outer, version, given, case.settings)
        assert before == (digest(params), digest(outer.to_arrays()), [digest(g.tensors) for g in given])
        again = merge_round(case.fragment, params, outer, version, given, case.settings)
        assert digest(again.params) == digest(result.params)  # a dropped result can simply be recomputed
        params, outer = result.params, result.outer
    assert outer.steps == 1 + 3 + 2


def test_compressed_downloads_lose_nothing_the_outer_steps_made() -> None:
    """With ``down_codec`` each version is the previous one plus the decoded update, and the
    residual carries the rest: version + residual follows the uncompressed run's versions (the outer
    step depends on the contributions and the momentum only), and the update payload makes the
    version from the previous one bit for bit."""
    plain, down = cases()[0], cases()[-1]
    assert down.settings.down_codec == "int2"
    exact, exact_outer = dict(plain.params), OuterState()
    params, outer = dict(down.params), OuterState()
    for version, given in enumerate(down.rounds):
        ref = merge_round(plain.fragment, exact, exact_outer, version, given, plain.settings)
        result = merge_round(down.fragment, params, outer, version, given, down.settings)
        assert ref.down_blob is None
        assert not ref.outer.residual
        assert result.down_blob is not None
        made = downlink.apply(version, params, result.down_blob, down.fragment)
        assert made is not None
        assert made[0] == result.version
        for name in params:
            np.testing.assert_array_equal(made[1][name], result.params[name])
            np.testing.assert_allclose(
                result.params[name] + result.outer.residual[name], ref.params[name], atol=1e-5
            )
            assert not np.array_equal(result.params[name], ref.params[name])  # int2 really is lossy
            np.testing.assert_array_equal(result.outer.momentum[name], ref.outer.momentum[name])
        exact, exact_outer, params, outer = ref.params, ref.outer, result.params, result.outer
    restored = OuterState.from_arrays(outer.to_arrays())  # the residual is stored with the outer state
    assert restored.residual.keys() == outer.residual.keys()
    for name, value in outer.residual.items():
        np.testing.assert_array_equal(restored.residual[name], value)


def _given(base: int, steps: int, tokens: int) -> Given:
    return Given("x", base, steps, tokens, {"w": np.zeros(2, np.float32)})


def test_weights_are_token_weights_discounted_by_staleness_and_fall_back_to_equal() -> None:
    settings = DiLoCoSettings(staleness_power=1.0)
    got = round_weights([_given(5, 4, 40), _given(4, 2, 40)], 5, settings)
    assert got == pytest.approx([400.0, 800.0 / 2])
    assert round_weights([_given(5, 4, 0), _given(4, 2, 0)], 5, settings) == [1.0, 1.0]
    assert round_weights([_given(5, 4, 40)], 5, DiLoCoSettings(token_weighting=False)) == [1.0]


def test_the_result_says_what_the_round_did() -> None:
    case = cases()[0]
    given = case.rounds[1]
    result = merge_round(case.fragment, case.params, OuterState(), 1, given, case.settings)
    assert result.version == 2
    assert result.staleness == (0, 1, 0)
    assert len(result.weights) == 3
    assert set(result.update) == set(case.params)
    with pytest.raises(ValueError, match="nothing to merge"):
        merge_round(case.fragment, case.params, OuterState(), 1, [], case.settings)
