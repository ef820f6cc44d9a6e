"""The sum of squares of a quantized tensor from its codes, against decoding it and summing."""

from __future__ import annotations

import math

import numpy as np
import pytest
from diloco_core import code_norms
from diloco_core import quantize as q


def _decoded(values: bytes, scales: bytes, quantizer: str, n: int, block: int) -> float:
    x = q.dequantize(values, scales, quantizer, n, block).astype(np.float64)
    return float(np.sum(x * x))


@pytest.mark.parametrize("quantizer", ["int8", "int4", "e3m0", "int2", "int1", "topk", "fp32", "bf16"])
@pytest.mark.parametrize(("n", "block"), [(4096, 256), (5000, 256), (1001, 8), (77, 64), (999, 12), (3, 256)])
def test_the_sum_from_codes_is_the_sum_of_the_decoded_values(quantizer: str, n: int, block: int) -> None:
    x = np.random.default_rng(n + block).standard_normal(n, dtype=np.float32) * np.float32(3)
    x[: n // 7] = 0  # a few blocks of zeros (scale 0)
    values, scales = (bytes(b) for b in q.quantize(x, quantizer, block))
    got = code_norms.sum_squares(values, scales, quantizer, n, block)
    assert got == pytest.approx(_decoded(values, scales, quantizer, n, block), rel=1e-6)


@pytest.mark.parametrize("quantizer", ["int8", "int4", "e3m0", "int2", "int1"])
def test_every_code_counts_as_its_level(quantizer: str) -> None:
    """Arbitrary bytes (codes an encoder never writes, such as int8's -128, included) read as the
    decoder reads them."""
    rng = np.random.default_rng(1)
    n, block = 64 * 256, 256
    values = rng.integers(0, 256, q.data_nbytes(quantizer, n, block), dtype=np.uint8).tobytes()
    scales = rng.uniform(0.1, 10.0, n // block).astype("<f4").tobytes()
    got = code_norms.sum_squares(values, scales, quantizer, n, block)
    assert got == pytest.approx(_decoded(values, scales, quantizer, n, block), rel=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("quantizer", ["int8", "int4", "e3m0", "int2", "int1"])
def test_a_scale_that_is_not_finite_gives_inf(quantizer: str, bad: float) -> None:
    n, block = 1024, 256
    values, scales = q.quantize(np.ones(n, dtype=np.float32), quantizer, block)
    s = np.frombuffer(scales, dtype="<f4").copy()
    s[2] = bad
    assert code_norms.sum_squares(bytes(values), s.tobytes(), quantizer, n, block) == math.inf


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")
@pytest.mark.parametrize("quantizer", ["int8", "int4"])
def test_a_scale_whose_values_overflow_float32_is_decoded(quantizer: str) -> None:
    """``level * scale`` past float32's largest value decodes to inf: the sum is not finite, as the
    decoded values' is."""
    n, block = 512, 256
    values = np.full(
        q.data_nbytes(quantizer, n, block), 0x80 if quantizer == "int8" else 0x00, dtype=np.uint8
    )
    scales = np.full(n // block, np.finfo(np.float32).max, dtype="<f4").tobytes()
    expected = _decoded(values.tobytes(), scales, quantizer, n, block)
    assert not math.isfinite(expected)
    assert not math.isfinite(code_norms.sum_squares(values.tobytes(), scales, quantizer, n, block))


def test_an_array_sum_is_taken_in_float64() -> None:
    x = np.full(300_000, 1e20, dtype=np.float32)  # each square overflows float32
    assert code_norms.array_sum_squares(x) == pytest.approx(300_000 * float(np.float32(1e20)) ** 2)
    assert code_norms.array_sum_squares(np.zeros(0, dtype=np.float32)) == 0.0


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("n", [1, (1 << 16) - 1, 1 << 16, (1 << 16) + 1, 3 * (1 << 16) + 5])
def test_an_array_sum_is_each_chunk_s_sum_widened_added_in_order(dtype: type, n: int) -> None:
    """The sum's rounding is part of what a round decides (an update scaled to its bound), so its
    order is pinned: chunks of 65,536 values widened to float64, each summed by ``einsum``, added in
    order."""
    x = (np.random.default_rng(n).standard_normal(n) * 100).astype(dtype)
    want = 0.0
    for start in range(0, n, 1 << 16):
        chunk = x[start : start + (1 << 16)].astype(np.float64)
        want += float(np.einsum("i,i->", chunk, chunk))
    assert code_norms.array_sum_squares(x) == want
    assert code_norms.array_sum_squares(x.reshape(-1, 1)[::-1]) == code_norms.array_sum_squares(
        x[::-1].copy()
    )


def test_a_norm_of_arrays_is_finite_exactly_when_every_value_is() -> None:
    """What lets a round skip reading its update for finiteness when its norm is finite."""
    top = np.full(1 << 20, np.finfo(np.float32).max, dtype=np.float32)
    assert math.isfinite(code_norms.arrays_norm({"a": top, "b": -top}))
    for bad in (np.inf, -np.inf, np.nan):
        top[12345] = bad
        assert not math.isfinite(code_norms.arrays_norm({"a": np.ones(3, np.float32), "b": top}))


def test_a_block_whose_sum_passes_32_bits_is_summed_in_64() -> None:
    n = block = 1 << 18  # int8: up to 2 * 128**2 per 16-bit word, 2**17 words in the block
    values = np.full(n, 0x80, dtype=np.uint8).tobytes()  # every code -128
    scales = np.ones(1, dtype="<f4").tobytes()
    got = code_norms.sum_squares(values, scales, "int8", n, block)
    assert got == pytest.approx(n * (128 / 127) ** 2, rel=1e-9)
