"""Two sets of named tensors that an operation pairs up value by value (parameters and an outer
gradient, a version and its update, a residual and what it is added to): the same names, each
with the same shape, or a ``ValueError`` that says which."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def check_same_tensors(first: Mapping[str, Any], second: Mapping[str, Any], names: tuple[str, str]) -> None:
    """``ValueError`` unless ``first`` and ``second`` name the same tensors with the same shapes;
    ``names``: what the two are called in the message."""
    a, b = names
    if set(first) != set(second):
        raise ValueError(f"{a} and {b} name different tensors: {sorted(set(first) ^ set(second))}")
    for name in first:
        if np.shape(first[name]) != np.shape(second[name]):
            raise ValueError(f"tensor {name!r}: {a} {np.shape(first[name])} vs {b} {np.shape(second[name])}")
