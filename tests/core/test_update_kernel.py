"""The compiled int2 download update against the quantizer and decoder it stands for; its use by
``downlink.publish`` is checked in tests/core/test_downlink.py, on both paths."""

from __future__ import annotations

import numpy as np
import pytest
from diloco_core import compiled, update_kernel
from diloco_core import quantize as q

pytest.importorskip("numba")


@pytest.mark.parametrize("block", [8, 9, 256])
@pytest.mark.parametrize("with_residual", [True, False])
def test_the_loop_writes_the_quantizers_codes_and_scales_and_the_decoded_rest(
    block: int, with_residual: bool
) -> None:
    rng = np.random.default_rng(block)
    n = 5 * block + 3  # a partial last block
    previous = rng.standard_normal(n).astype(np.float32)
    merged = previous + np.float32(0.1) * rng.standard_normal(n).astype(np.float32)
    merged[block : 2 * block] = previous[block : 2 * block]  # a block of zeros (without a residual)
    merged[2 * block + 1 : 2 * block + 4] = previous[2 * block + 1 : 2 * block + 4]  # zeros at both parities
    merged[3 * block + 2] = np.inf  # a block whose scale is not finite
    residual = np.float32(0.01) * rng.standard_normal(n).astype(np.float32)
    loop = compiled.compile_now(update_kernel.INT2_UPDATE)
    assert loop is not None
    params, rest = np.empty(n, np.float32), np.empty(n, np.float32)
    codes, scales = np.zeros(-(-n // 4), np.uint8), np.empty(-(-n // block), np.float32)
    nan = np.uint32(q.CANONICAL_NAN_BITS).view(np.float32)
    ro = compiled.read_only
    loop(params, rest, codes, scales, ro(previous), ro(merged), ro(residual), with_residual, block, nan)

    with np.errstate(invalid="ignore"):
        c = (merged - previous) + residual if with_residual else merged - previous
        want_codes, want_scales = q.quantize(c, "int2", block)
        decoded = q.dequantize(want_codes, want_scales, "int2", n, block)
        assert codes.tobytes() == want_codes
        assert scales.astype("<f4").tobytes() == want_scales
        np.testing.assert_array_equal(params.view(np.uint32), (previous + decoded).view(np.uint32))
        np.testing.assert_array_equal(rest.view(np.uint32), (c - decoded).view(np.uint32))
