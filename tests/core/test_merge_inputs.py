"""Contributions as a round merges them: a norm measured as the tensors are read is the norm
``tensors_norm`` takes of them, and is known only once every tensor was read."""

from __future__ import annotations

import math

import numpy as np
from diloco_core.merge_inputs import MeasuredTensors
from diloco_core.screening import tensors_norm


def test_the_norm_measured_while_reading_is_tensors_norm_once_every_tensor_was_read() -> None:
    rng = np.random.default_rng(0)
    tensors = {name: rng.standard_normal(n, dtype=np.float32) for name, n in (("b", 70_000), ("a", 5))}
    measured = MeasuredTensors(tensors)
    assert sorted(measured) == ["a", "b"]
    assert len(measured) == 2
    np.testing.assert_array_equal(measured["b"], tensors["b"])
    assert measured.norm() is None  # "a" not read yet
    measured["a"]
    assert measured.norm() == tensors_norm(tensors)  # the same sums, in the same order


def test_a_value_that_is_not_finite_measures_as_an_infinite_norm() -> None:
    measured = MeasuredTensors({"w": np.array([1.0, np.nan], np.float32)})
    measured["w"]
    assert measured.norm() == math.inf
