"""Two sets of named tensors paired value by value: the same names and shapes, or a clear error."""

from __future__ import annotations

import numpy as np
import pytest
from diloco_core.tensor_match import check_same_tensors


def test_the_same_names_and_shapes_pass_whatever_the_dtype() -> None:
    check_same_tensors(
        {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float64)},
        {"b": np.ones(3, np.float32), "w": np.ones((2, 3), np.float16)},
        ("params", "delta"),
    )
    check_same_tensors({}, {}, ("params", "delta"))


def test_a_name_on_one_side_only_is_named() -> None:
    with pytest.raises(ValueError, match=r"params and delta name different tensors: \['b', 'c'\]"):
        check_same_tensors(
            {"w": np.zeros(1), "b": np.zeros(1)}, {"w": np.zeros(1), "c": np.zeros(1)}, ("params", "delta")
        )


def test_a_shape_that_differs_is_named_with_both_shapes() -> None:
    with pytest.raises(ValueError, match=r"tensor 'w': merged \(2, 3\) vs previous \(3, 2\)"):
        check_same_tensors({"w": np.zeros((2, 3))}, {"w": np.zeros((3, 2))}, ("merged", "previous"))
