"""An accepted contribution is checked whole and held quantized: an int4 outer gradient costs the
synchronizer about half a byte per value while it waits for its round, not float32's four."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from diloco_core import codec
from diloco_core.fragments import build_plan
from diloco_core.screening import tensors_norm
from diloco_sync.errors import ApiError
from diloco_sync.ingest import validate_outer_gradient

PLAN = build_plan([("h.0.w", [1024, 512]), ("h.1.w", [512, 512])], 1, 4, 1)
SPEC = PLAN.fragments[0]


def _blob(values: dict[str, np.ndarray], quantizer: str = "int4") -> bytes:
    return codec.encode(values, fragment=0, base_version=3, kind="outer_grad", quantizer=quantizer)


def _gradient(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in SPEC.tensors}


def test_an_int4_contribution_is_held_in_well_under_a_byte_per_value() -> None:
    blob = _blob(_gradient())
    validate_outer_gradient(blob, SPEC, 3, 1 << 30)  # the codes' table is made once per process
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        checked = validate_outer_gradient(blob, SPEC, 3, 1 << 30)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 0.6 * SPEC.numel, f"{held} bytes held for {SPEC.numel} values"
    expected = codec.decode(blob).tensors
    for name, value in expected.items():
        np.testing.assert_array_equal(checked.tensors[name], value)
    # measured from the codes: the decoded values' norm but for their float32 rounding
    assert checked.norm == pytest.approx(tensors_norm(expected), rel=1e-6)


def test_a_non_finite_value_is_refused_when_the_contribution_is_checked() -> None:
    values = _gradient()
    values["h.1.w"][7, 3] = np.inf
    with pytest.raises(ApiError) as refused:
        validate_outer_gradient(_blob(values, "fp32"), SPEC, 3, 1 << 30)
    assert (refused.value.status, refused.value.code) == (400, "non_finite")
    assert "h.1.w" in refused.value.body.reason
