"""Learner-side state: outer gradient, applying a global version, per-fragment counters."""

from __future__ import annotations

import numpy as np
import pytest
from diloco_core.fragments import build_plan
from diloco_core.learner import FragmentCounters, apply_global, outer_gradient


def test_outer_gradient_is_anchor_minus_params() -> None:
    anchor = {"w": np.array([1.0, 2.0], np.float32)}
    params = {"w": np.array([0.5, 3.0], np.float32)}
    np.testing.assert_array_equal(outer_gradient(anchor, params)["w"], [0.5, -1.0])
    with pytest.raises(ValueError, match="different tensors"):
        outer_gradient(anchor, {"v": params["w"]})


def test_apply_global_mixes_with_alpha() -> None:
    local = {"w": np.array([0.0, 4.0], np.float32)}
    glob = {"w": np.array([2.0, 0.0], np.float32)}
    out = apply_global(local, glob, 0.0)
    np.testing.assert_array_equal(out["w"], glob["w"])
    assert out["w"] is not glob["w"]
    np.testing.assert_allclose(apply_global(local, glob, 0.5)["w"], [1.0, 2.0])
    with pytest.raises(ValueError, match="alpha"):
        apply_global(local, glob, 1.5)


def test_counters_make_fragments_fall_due_at_different_steps() -> None:
    plan = build_plan([(f"h.{i}.w", (4,)) for i in range(4)], num_fragments=4, inner_steps=8, overlap=1)
    counters = FragmentCounters.start(plan, {0: 3})
    assert counters.steps == (0, -2, -4, -6)
    assert counters.base_version == (3, -1, -1, -1)
    due_at: dict[int, int] = {}
    for step in range(1, 15):
        counters = counters.advance(tokens=100)
        for p in counters.due(plan):
            due_at.setdefault(p, step)
    assert due_at == {0: 8, 1: 10, 2: 12, 3: 14}
    # tokens count only steps after the counter passed zero, so tokens / steps is tokens per step
    assert counters.tokens[0] == 14 * 100
    assert counters.tokens[3] == 8 * 100
    counters = counters.reset(0, base_version=4)
    assert (counters.steps[0], counters.tokens[0], counters.base_version[0]) == (0, 0, 4)
    assert FragmentCounters.from_dict(counters.to_dict()) == counters
    with pytest.raises(IndexError):
        counters.reset(9, 1)
    with pytest.raises(ValueError, match="malformed"):
        FragmentCounters.from_dict({"steps": [1], "tokens": [1, 2], "base_version": [0]})
