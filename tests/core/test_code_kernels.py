"""The compiled loops over codes, through the functions that call them: what the decoding and sum
tests elsewhere (test_code_levels, test_code_norms) do not reach."""

from __future__ import annotations

import numpy as np
import pytest
from diloco_core import code_kernels, code_levels, code_norms
from diloco_core import quantize as q


@pytest.mark.parametrize("quantizer", ["int8", "int4", "e3m0", "int2", "int1"])
@pytest.mark.parametrize(("n", "block_size"), [(13, 9), (21, 10), (100, 11), (1001, 12)])
def test_blocks_that_start_and_end_inside_bytes_add_each_value_once(
    quantizer: str, n: int, block_size: int
) -> None:
    """int1 packs eight values in a byte: a block of 9 to 12 starts or ends inside one, and a last
    partial block can lie wholly inside one."""
    rng = np.random.default_rng(n * block_size)
    values, scales = q.quantize(rng.standard_normal(n).astype(np.float32), quantizer, block_size)
    decoded = q.dequantize(values, scales, quantizer, n, block_size)
    acc = np.zeros(n, dtype=np.float32)
    for _ in range(3):
        q.add_dequantized(acc, np.float32(1), values, scales, quantizer, n, block_size)
    np.testing.assert_array_equal(acc, decoded + decoded + decoded)


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")
def test_only_the_blocks_with_a_scale_past_the_safe_bound_are_decoded_for_their_squares() -> None:
    n, block = 1024, 256
    values, scales = q.quantize(np.random.default_rng(2).standard_normal(n).astype(np.float32), "int4", block)
    values = bytes(values[:384]) + bytes(128)  # the last block's codes 0: level -8 / 7
    s = np.frombuffer(scales, dtype="<f4").copy()
    s[1] = np.float32(2.5e38)  # past the bound, yet no value of the block overflows: |level| <= 8 / 7
    s[3] = np.finfo(np.float32).max  # -8 / 7 of it overflows
    decoded = q.dequantize(bytes(values), s.tobytes(), "int4", n, block).astype(np.float64)
    got = code_norms.sum_squares(bytes(values), s.tobytes(), "int4", n, block)
    assert np.isfinite(decoded[:768]).all() and not np.isfinite(decoded[768:]).all()
    assert got == np.inf
    s[3] = 1.0
    decoded = q.dequantize(bytes(values), s.tobytes(), "int4", n, block).astype(np.float64)
    got = code_norms.sum_squares(bytes(values), s.tobytes(), "int4", n, block)
    assert got == pytest.approx(float(np.sum(decoded * decoded)), rel=1e-9)


@pytest.mark.parametrize("quantizer", ["int8", "int4", "int1"])
def test_codes_or_scales_too_short_for_the_values_are_refused_before_any_loop(quantizer: str) -> None:
    """The loops check no bounds: a caller's wrong length is a ValueError, never a read past the end."""
    n, block = 1000, 100
    values, scales = q.quantize(np.ones(n, dtype=np.float32), quantizer, block)
    s = np.frombuffer(scales, dtype="<f4")
    short = bytes(values)[:-1]
    with pytest.raises(ValueError, match="need more codes or scales"):
        code_levels.decode(short, s, quantizer, n, block)
    with pytest.raises(ValueError, match="need more codes or scales"):
        code_levels.add_decoded(np.zeros(n, np.float32), np.float32(2), values, s[:-1], quantizer, n, block)
    with pytest.raises(ValueError, match="need more codes or scales"):
        code_norms.sum_squares(short, scales, quantizer, n, block)
    with pytest.raises(ValueError, match="contiguous"):
        code_levels.add_decoded(
            np.zeros(2 * n, np.float32)[::2], np.float32(2), values, s, quantizer, n, block
        )


def test_each_width_and_operation_is_compiled_once() -> None:
    assert code_kernels.decoder(4, code_kernels.ADD) is code_kernels.decoder(4, code_kernels.ADD)
    assert code_kernels.decoder(4, code_kernels.ADD) is not code_kernels.decoder(4, code_kernels.WRITE)
