from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from diloco_core import code_kernels, code_levels
from diloco_core import quantize as q

from tests.core.loops import PATHS, take_path

F32 = npt.NDArray[np.float32]


@pytest.fixture(autouse=True, params=PATHS)
def loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here runs on the numpy code and on the compiled loops, which must give the same bits."""
    modes = (code_kernels.WRITE, code_kernels.ADD, code_kernels.ADD_SCALED)
    every = [code_kernels.decoder(q, bits, m) for q, bits in code_levels.BITS.items() for m in modes]
    take_path(request, monkeypatch, *every)


def _codes(values: bytes | memoryview, n: int, bits: int) -> npt.NDArray[np.uint8]:
    packed = np.frombuffer(values, dtype=np.uint8)
    per, mask = 8 // bits, (1 << bits) - 1
    return np.stack([(packed >> (i * bits)) & mask for i in range(per)], axis=1).reshape(-1)[:n]


def _value_by_value(
    values: bytes | memoryview, scales: bytes, quantizer: str, n: int, block_size: int
) -> F32:
    """Each format's formula over whole arrays, every block's scale repeated over its values."""
    per_value = np.repeat(np.frombuffer(scales, "<f4"), block_size)[:n]
    c = _codes(values, n, code_levels.BITS[quantizer])
    if quantizer == "int8":
        return c.view(np.int8).astype(np.float32) * (per_value / np.float32(127))
    if quantizer == "int4":
        return ((c.astype(np.float32) - 8) / np.float32(7)).astype(np.float32) * per_value
    if quantizer == "e3m0":
        sign = np.where(c & 8, np.float32(-1), np.float32(1))
        level = np.where(c & 7, np.float32(2) ** ((c & 7).astype(np.float32) - 7), np.float32(0))
        return (sign * level).astype(np.float32) * per_value
    if quantizer == "int2":
        return (c.astype(np.float32) * np.float32(2) - np.float32(3)) / np.float32(3) * per_value
    return np.where(c == 1, np.float32(-1), np.float32(1)).astype(np.float32) * per_value


@pytest.mark.parametrize("quantizer", ["int8", "int4", "e3m0", "int2", "int1"])
@pytest.mark.parametrize(
    ("n", "block_size"),
    [(1, 8), (7, 8), (13, 9), (259, 256), (70_001, 256), (200_003, 1 << 17), (140_001, 9), (262_147, 8)],
)
def test_a_blocked_format_decodes_bit_for_bit_as_its_formula_value_by_value(
    quantizer: str, n: int, block_size: int
) -> None:
    rng = np.random.default_rng(n + block_size)
    x = (rng.standard_normal(n) * rng.choice([1e-30, 1e-3, 1.0, 1e3, 1e30], n)).astype(np.float32)
    x[n // 2] = np.nan  # a block with a NaN scale decodes to NaN throughout
    values, scales = q.quantize(x, quantizer, block_size)
    got = q.dequantize(values, scales, quantizer, n, block_size)
    assert (got.dtype, got.shape, got.flags.writeable) == (np.float32, (n,), True)
    expected = _value_by_value(values, scales, quantizer, n, block_size)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("quantizer", ["int8", "int4", "e3m0", "int2", "int1"])
def test_every_byte_of_codes_decodes_to_its_formula(quantizer: str) -> None:
    bits = code_levels.BITS[quantizer]
    n = 256 * (8 // bits)
    values = np.arange(256, dtype=np.uint8).tobytes()  # every byte once, in one block of scale 3
    scales = np.array([3.0], dtype="<f4").tobytes()
    got = q.dequantize(values, scales, quantizer, n, n)
    expected = _value_by_value(values, scales, quantizer, n, n)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_a_decode_allocates_nothing_the_size_of_the_tensor_beyond_its_result() -> None:
    import tracemalloc

    n = 1 << 21
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    values, scales = q.quantize(x, "int2", 256)
    tracemalloc.start()
    out = q.dequantize(values, scales, "int2", n, 256)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < out.nbytes * 1.25


@pytest.mark.parametrize("quantizer", ["int8", "int4", "e3m0", "int2", "int1"])
@pytest.mark.parametrize(("n", "block_size"), [(1, 8), (13, 9), (259, 256), (140_001, 9), (200_003, 1 << 17)])
def test_adding_decoded_values_is_bit_for_bit_decoding_multiplying_and_adding(
    quantizer: str, n: int, block_size: int
) -> None:
    rng = np.random.default_rng(n * block_size)
    x = (rng.standard_normal(n) * rng.choice([1e-30, 1e-3, 1.0, 1e3], n)).astype(np.float32)
    values, scales = q.quantize(x, quantizer, block_size)
    start = rng.standard_normal(n).astype(np.float32)
    for factor in (np.float32(rng.uniform(0.1, 3)), np.float32(1)):  # 1: the product is not taken
        acc = start.copy()
        q.add_dequantized(acc, factor, values, scales, quantizer, n, block_size)
        product = q.dequantize(values, scales, quantizer, n, block_size) * factor
        expected = start + product
        assert product.dtype == expected.dtype == np.float32
        np.testing.assert_array_equal(acc.view(np.uint32), expected.view(np.uint32))


def test_adding_decoded_values_allocates_nothing_the_size_of_the_tensor() -> None:
    import tracemalloc

    n = 1 << 21
    values, scales = q.quantize(np.random.default_rng(0).standard_normal(n).astype(np.float32), "int4", 256)
    acc = np.zeros(n, dtype=np.float32)
    tracemalloc.start()
    q.add_dequantized(acc, np.float32(0.5), values, scales, "int4", n, 256)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < acc.nbytes * 0.25


@pytest.mark.parametrize("quantizer", ["fp32", "fp16", "bf16", "topk", q.PLANES])
def test_only_the_blocked_formats_are_added_a_chunk_at_a_time(quantizer: str) -> None:
    assert not q.decodes_in_chunks(quantizer)
    with pytest.raises(ValueError, match="not decoded a chunk at a time"):
        q.add_dequantized(np.zeros(4, np.float32), np.float32(1), b"", b"", quantizer, 4, 4)


def test_a_sum_that_is_not_contiguous_is_added_into_by_the_numpy_code() -> None:
    n, block = 1000, 100
    values, scales = q.quantize(np.ones(n, dtype=np.float32), "int4", block)
    s = np.frombuffer(scales, dtype="<f4")
    strided = np.zeros(2 * n, np.float32)[::2]
    code_levels.add_decoded(strided, np.float32(2), values, s, "int4", n, block)
    np.testing.assert_array_equal(strided, np.full(n, 2, np.float32))
