"""Merge rules: token weights, weighted mean, RDA norm invariance, non-finite rejection."""

from __future__ import annotations

import numpy as np
import pytest
from diloco_core.merge import check_finite, contribution_weight, merge_fragment, rda, weighted_mean
from hypothesis import given, settings
from hypothesis import strategies as st


def test_token_weight_is_quantity_times_quality() -> None:
    # 1000 tokens in 10 steps (100 per step) vs 1000 tokens in 20 steps (50 per step)
    assert contribution_weight(1000, 10) == 100_000.0
    assert contribution_weight(1000, 20) == 50_000.0
    assert contribution_weight(1000, 20, token_weighting=False) == 1.0
    assert contribution_weight(100, 1, staleness=3, staleness_power=0.5) == pytest.approx(10_000 / 2)
    with pytest.raises(ValueError, match="at least one inner step"):
        contribution_weight(10, 0)
    with pytest.raises(ValueError, match=">= 0"):
        contribution_weight(-1, 3)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 10**6), st.integers(1, 10**4), st.integers(0, 20), st.floats(0, 2))
def test_weights_are_positive_and_fall_with_staleness(
    tokens: int, steps: int, stale: int, power: float
) -> None:
    fresh = contribution_weight(tokens, steps, staleness=0, staleness_power=power)
    old = contribution_weight(tokens, steps, staleness=stale, staleness_power=power)
    assert fresh == pytest.approx(tokens * tokens / steps)
    assert 0 < old <= fresh
    # twice the tokens in the same steps weighs four times as much (twice the quantity, twice the quality)
    assert contribution_weight(2 * tokens, steps) == pytest.approx(4 * contribution_weight(tokens, steps))


def test_weighted_mean_matches_the_formula() -> None:
    a, b = np.array([1.0, 2.0], np.float32), np.array([3.0, 6.0], np.float32)
    np.testing.assert_allclose(weighted_mean([a, b], [1, 3]), [2.5, 5.0])
    np.testing.assert_array_equal(weighted_mean([a], [5.0]), a)
    with pytest.raises(ValueError, match="sum to zero"):
        weighted_mean([a, b], [0, 0])
    with pytest.raises(ValueError, match="2 contributions but 1 weights"):
        weighted_mean([a, b], [1])
    with pytest.raises(ValueError, match="different shapes"):
        weighted_mean([a, np.ones(3, np.float32)], [1, 1])


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 16), st.integers(2, 64), st.floats(0.01, 100), st.integers(0, 2**31 - 1))
def test_rda_keeps_the_common_norm_for_any_number_of_learners(
    m: int, dim: int, radius: float, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    vectors = [rng.standard_normal(dim).astype(np.float32) for _ in range(m)]
    vectors = [(v / np.linalg.norm(v) * radius).astype(np.float32) for v in vectors]
    weights = list(rng.uniform(0.1, 10, m))
    merged = rda(vectors, weights)
    direction = sum(w * v / np.linalg.norm(v) for w, v in zip(weights, vectors, strict=True))
    if np.linalg.norm(direction) / sum(weights) < 1e-3:
        return  # the mean direction vanished: RDA falls back to the mean (tested separately)
    assert np.linalg.norm(merged) == pytest.approx(radius, rel=1e-4)


def test_rda_of_orthogonal_vectors_keeps_the_norm_while_the_mean_shrinks() -> None:
    m = 16
    vectors = [np.eye(m, dtype=np.float32)[i] * 3.0 for i in range(m)]
    assert np.linalg.norm(weighted_mean(vectors, [1.0] * m)) == pytest.approx(3.0 / np.sqrt(m))
    assert np.linalg.norm(rda(vectors, [1.0] * m)) == pytest.approx(3.0)


def test_rda_falls_back_to_the_mean_for_opposite_vectors() -> None:
    a = np.array([1.0, 0.0], np.float32)
    np.testing.assert_array_equal(rda([a, -a], [1, 1]), [0.0, 0.0])
    np.testing.assert_allclose(rda([a, -2 * a], [1, 1]), weighted_mean([a, -2 * a], [1, 1]))


def test_merge_fragment_uses_rda_for_dense_and_the_mean_for_embeddings() -> None:
    d1 = {"w": np.array([2.0, 0.0], np.float32), "b": np.array([1.0], np.float32)}
    d2 = {"w": np.array([0.0, 2.0], np.float32), "b": np.array([3.0], np.float32)}
    dense = merge_fragment([d1, d2], [1, 1], rule="rda", kind="dense")
    assert np.linalg.norm(dense["w"]) == pytest.approx(2.0)
    emb = merge_fragment([d1, d2], [1, 1], rule="rda", kind="embedding")
    np.testing.assert_allclose(emb["w"], [1.0, 1.0])
    mean = merge_fragment([d1, d2], [1, 3], rule="mean", kind="dense")
    np.testing.assert_allclose(mean["b"], [2.5])
    with pytest.raises(ValueError, match="contribution 1 has tensors"):
        merge_fragment([d1, {"w": d2["w"]}], [1, 1], rule="mean", kind="dense")
    with pytest.raises(ValueError, match="unknown merge rule"):
        merge_fragment([d1], [1], rule="median", kind="dense")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no contributions"):
        merge_fragment([], [], rule="mean", kind="dense")


def test_check_finite_names_the_offending_tensor() -> None:
    assert check_finite({"a": np.ones(3, np.float32)}) is None
    assert check_finite({"a": np.ones(3), "h.0.attn.weight": np.array([1.0, np.nan])}) == (
        "non-finite values in 'h.0.attn.weight'"
    )
    assert check_finite({"x": np.array([np.inf], np.float32)}) == "non-finite values in 'x'"
