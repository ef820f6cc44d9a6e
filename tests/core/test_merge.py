"""Merge rules: token weights, weighted mean, RDA norm invariance, non-finite rejection."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from diloco_core import codec
from diloco_core.bounds import MAX_STEPS, MAX_TOKENS
from diloco_core.fragments import build_plan
from diloco_core.merge import (
    _ADD_BLOCK,
    _FINITE_CHUNK,
    check_finite,
    contribution_weight,
    merge_fragment,
    rda,
    weighted_mean,
)
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


def test_the_blocked_sum_is_bit_for_bit_the_whole_array_sum() -> None:
    """Blocks of the scaled sum (several, the last partial) give what whole-array float32 operations
    give: each product rounded to float32, then added in the contributions' order."""
    n = 3 * _ADD_BLOCK + 7
    rng = np.random.default_rng(3)
    vs = [rng.standard_normal(n).astype(np.float32) * np.float32(10.0**k) for k in range(3)]
    ws = [0.2, 1.3, 0.7]
    scaled = [w / max(ws) for w in ws]  # the weights as the merge normalises them
    expected = np.zeros(n, np.float32)
    for v, w in zip(vs, scaled, strict=True):
        expected = expected + np.multiply(v, np.float32(w / sum(scaled)), dtype=np.float32)
    np.testing.assert_array_equal(weighted_mean(vs, ws), expected)


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


@pytest.mark.parametrize("at", [0, _FINITE_CHUNK - 1, _FINITE_CHUNK, 3 * _FINITE_CHUNK + 5])
def test_a_value_that_is_not_finite_is_found_in_any_chunk(at: int) -> None:
    x = np.ones((3 * _FINITE_CHUNK + 6,), np.float32)
    assert check_finite({"x": x.reshape(2, -1)}) is None
    x[at] = np.nan if at % 2 else -np.inf
    assert check_finite({"x": x.reshape(2, -1)}) == "non-finite values in 'x'"


@pytest.mark.parametrize(
    "tokens", [2 * 10**19, 13 * 10**153, 10**200, 10**5000], ids=["2e19", "1.3e154", "1e200", "1e5000"]
)
def test_tokens_beyond_the_bounds_are_refused_with_the_bound_not_an_overflow(tokens: int) -> None:
    """Tokens no learner can have trained on: a ValueError naming the bound, never OverflowError,
    inf or a float that overflows once two such weights are added."""
    with pytest.raises(ValueError, match="beyond what a learner can report"):
        contribution_weight(tokens, 1)
    with pytest.raises(ValueError, match="beyond what a learner can report"):
        contribution_weight(32, MAX_STEPS + 1)


def test_the_largest_weights_within_the_bounds_merge_to_finite_values() -> None:
    """Two learners at the bounds (the largest weight there is) and a normal one: every merge rule
    gives the convex combination of the contributions, finite."""
    top = contribution_weight(MAX_TOKENS, 1)
    assert np.isfinite(top)
    assert np.isfinite(top + top + top)
    rng = np.random.default_rng(3)
    deltas = [{"w": (1e6 * rng.standard_normal(64)).astype(np.float32)} for _ in range(3)]
    weights = [top, top, contribution_weight(32, 4)]
    for rule, kind in (("mean", "dense"), ("rda", "dense"), ("rda", "embedding")):
        merged = merge_fragment(deltas, weights, rule=rule, kind=kind)["w"]  # type: ignore[arg-type]
        assert np.isfinite(merged).all(), (rule, kind)
    mean = merge_fragment(deltas, weights, rule="mean", kind="embedding")["w"]
    np.testing.assert_allclose(mean, (deltas[0]["w"] + deltas[1]["w"]) / 2, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize(
    "weights",
    [
        [4e38, 256.0],  # tokens 2e19 in one step, next to a normal contribution
        [1.69e308, 1.69e308],  # tokens 1.3e154 from two learners: each finite, their sum is not
        [1.7e308, 1.0, 1.7e308],
    ],
)
def test_merging_never_overflows_whatever_finite_weights_it_is_given(weights: list[float]) -> None:
    """Weights are divided by the largest before anything is summed or multiplied."""
    rng = np.random.default_rng(5)
    deltas = [{"w": rng.standard_normal((16, 8)).astype(np.float32)} for _ in weights]
    for rule, kind in (("mean", "embedding"), ("rda", "dense")):
        merged = merge_fragment(deltas, weights, rule=rule, kind=kind)["w"]  # type: ignore[arg-type]
        assert np.isfinite(merged).all(), (rule, kind, weights)
    top = max(weights)
    share = np.array([w / top for w in weights]) / sum(w / top for w in weights)
    expected = sum(s * d["w"] for s, d in zip(share, deltas, strict=True))
    np.testing.assert_allclose(
        weighted_mean([d["w"] for d in deltas], weights), expected, rtol=1e-5, atol=1e-6
    )


def test_embeddings_sharing_a_fragment_with_dense_tensors_are_still_merged_with_the_weighted_mean() -> None:
    rng = np.random.default_rng(7)
    deltas = [
        {
            "wte.weight": rng.standard_normal(8).astype(np.float32),
            "h.w": rng.standard_normal(8).astype(np.float32),
        }
        for _ in range(3)
    ]
    weights = [1.0, 2.0, 3.0]
    merged = merge_fragment(deltas, weights, rule="rda", kind="dense", mean_tensors=("wte.weight",))
    np.testing.assert_array_equal(
        merged["wte.weight"], weighted_mean([d["wte.weight"] for d in deltas], weights)
    )
    np.testing.assert_array_equal(merged["h.w"], rda([d["h.w"] for d in deltas], weights))


@pytest.mark.parametrize(("rule", "kind"), [("rda", "dense"), ("mean", "dense"), ("rda", "embedding")])
def test_a_merge_holds_one_contribution_at_a_time_whatever_their_number(rule: str, kind: str) -> None:
    """Contributions held quantized (as the synchronizer holds them) are read from their codes one
    at a time as the merge reads them, a chunk at a time: its peak is the sum and little more,
    for 2 contributions as for 16 (it was 2 + M copies when each tensor of every contribution was
    decoded at once). Its result is bit for bit the one from the decoded tensors for the weighted
    mean; RDA takes each contribution's norm from its codes in float64, the decoded tensors' is a
    float32 dot product, and the two results differ by that product's rounding only."""
    spec = build_plan([("w", [512, 512])], 1, 4, 1).fragments[0]
    rng = np.random.default_rng(0)
    peaks = {}
    for m in (2, 16):
        blobs = [
            codec.encode({"w": rng.standard_normal((512, 512), dtype=np.float32)}, fragment=0,
                         base_version=0, kind="outer_grad", quantizer="int4")
            for _ in range(m)
        ]  # fmt: skip
        lazy = [codec.decode_quantized(b, fragment=spec).tensors for b in blobs]
        weights = list(rng.uniform(1, 3, m))
        tracemalloc.start()
        try:
            merged = merge_fragment(lazy, weights, rule=rule, kind=kind)["w"]  # type: ignore[arg-type]
            peaks[m] = tracemalloc.get_traced_memory()[1] / (4 * 512 * 512)
        finally:
            tracemalloc.stop()
        decoded = [dict(codec.decode(b).tensors) for b in blobs]
        expected = merge_fragment(decoded, weights, rule=rule, kind=kind)["w"]  # type: ignore[arg-type]
        if rule == "rda" and kind == "dense":
            np.testing.assert_allclose(merged, expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))
        else:
            assert merged.tobytes() == expected.tobytes()
    assert peaks[16] < 2.5, peaks  # the sum and the scratch of a chunk (a quarter of this small tensor)
    assert peaks[16] < peaks[2] + 0.5, peaks
