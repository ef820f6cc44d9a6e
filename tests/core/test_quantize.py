"""The quantizers' exact rules: e3m0 levels by exact thresholds, non-finite input written canonically."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from diloco_core import quantize as q


def test_e3m0_thresholds_are_the_smallest_float32_above_each_midpoint() -> None:
    for k, t in enumerate(q.E3M0_THRESHOLDS):
        below = np.nextafter(t, np.float32(0))
        midpoint_squared = Fraction(2) ** (2 * k - 13)  # (2**(k - 6.5))**2
        assert Fraction(float(t)) ** 2 > midpoint_squared > Fraction(float(below)) ** 2


def test_e3m0_takes_the_level_nearest_in_log2_space_exactly_at_the_boundaries() -> None:
    """Next to each midpoint 2**(k - 6.5) between levels k and k + 1 (of a block of scale 1)."""
    values, expected = [np.float32(1.0)], [7]
    for k, t in enumerate(q.E3M0_THRESHOLDS):
        values += [np.nextafter(t, np.float32(0)), t]
        expected += [k, k + 1]
    x = np.array(values, dtype=np.float32)
    codes, scales = q.quantize(x, "e3m0", x.size)
    levels = np.frombuffer(codes, np.uint8)
    unpacked = np.stack([levels & 0x0F, levels >> 4], axis=1).reshape(-1)[: x.size]
    assert unpacked.tolist() == expected
    assert np.frombuffer(scales, "<f4").tolist() == [1.0]


@pytest.mark.parametrize("quantizer", ["int8", "int4", "e3m0", "int2", "int1", "topk"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_block_holding_a_non_finite_value_is_written_as_nan_scale_and_zero_codes(
    quantizer: str, bad: float
) -> None:
    x = np.linspace(-1, 1, 24, dtype=np.float32)
    x[10] = bad  # second block of 8
    values, scales = q.quantize(x, quantizer, 8)
    s = np.frombuffer(scales, "<u4")
    assert s[1] == q.CANONICAL_NAN_BITS
    assert np.isfinite(np.frombuffer(scales, "<f4")[[0, 2]]).all()
    y = q.dequantize(values, scales, quantizer, x.size, 8)
    assert np.isnan(y[8:16]).all()
    assert np.isfinite(y[:8]).all()
    assert np.isfinite(y[16:]).all()
    clean = x.copy()
    clean[8:16] = 0.0
    again, _ = q.quantize(clean, quantizer, 8)
    assert again == values  # the block's codes are those of zeros


def test_fp16_and_bf16_nan_keep_sign_and_payload_top_and_are_quiet() -> None:
    bits = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0x7FA00000, 0xFFFFFFFF], dtype=np.uint32)
    x = bits.view(np.float32)
    fp16 = np.frombuffer(q.quantize(x, "fp16", 256)[0], "<u2")
    assert [hex(v) for v in fp16] == ["0x7e00", "0xfe00", "0x7e00", "0x7f00", "0xffff"]
    bf16 = np.frombuffer(q.quantize(x, "bf16", 256)[0], "<u2")
    assert [hex(v) for v in bf16] == ["0x7fc0", "0xffc0", "0x7fc0", "0x7fe0", "0xffff"]


def test_int2_takes_the_nearest_of_four_levels_of_the_block_maximum() -> None:
    x = np.array([3.0, -3.0, 1.0, -1.0, 0.1, -0.1, 2.1, 1.9], dtype=np.float32)
    values, scales = q.quantize(x, "int2", 8)
    assert np.frombuffer(scales, "<f4").tolist() == [3.0]
    y = q.dequantize(values, scales, "int2", x.size, 8)
    assert y.tolist() == pytest.approx([3.0, -3.0, 1.0, -1.0, 1.0, -1.0, 3.0, 1.0])
    assert len(values) == 2  # four codes per byte


def test_int1_is_the_sign_times_the_mean_magnitude_of_the_real_values() -> None:
    x = np.array([1.0, -2.0, 3.0, -0.0, 4.0, -5.0, 6.0, 7.0, 8.0, -10.0], dtype=np.float32)
    values, scales = q.quantize(x, "int1", 8)
    means = np.frombuffer(scales, "<f4")
    assert means.tolist() == pytest.approx([28.0 / 8, 18.0 / 2])  # the last block has two values
    y = q.dequantize(values, scales, "int1", x.size, 8)
    assert np.sign(y).tolist() == [1, -1, 1, -1, 1, -1, 1, 1, 1, -1]
    assert len(values) == 2  # eight codes per byte


def test_topk_keeps_the_largest_magnitudes_of_each_block_and_zeroes_the_rest() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal(100).astype(np.float32)
    values, scales = q.quantize(x, "topk", 32)
    assert len(values) == q.data_nbytes("topk", 100, 32) == 3 * (3 * 8 + 4)  # three full blocks, one of 4
    y = q.dequantize(values, scales, "topk", x.size, 32)
    for b in range(4):
        block, out = x[32 * b : 32 * (b + 1)], y[32 * b : 32 * (b + 1)]
        kept = np.argsort(-np.abs(block), kind="stable")[: min(8, block.size)]
        dropped = np.setdiff1d(np.arange(block.size), kept)
        assert not out[dropped].any()
        assert np.abs(out[kept] - block[kept]).max() <= np.abs(block).max() / 254 * 1.0001


@pytest.mark.parametrize("corrupt", ["out_of_block", "repeated", "decreasing"])
def test_topk_decoding_refuses_indices_outside_their_block_or_out_of_order(corrupt: str) -> None:
    x = np.arange(1, 21, dtype=np.float32)  # a block of 16 and one of 4
    values, scales = q.quantize(x, "topk", 16)
    idx = np.frombuffer(values, "<u2", count=12).copy()
    if corrupt == "out_of_block":
        idx[11] = 4  # the last block has four values: indices 0..3
    elif corrupt == "repeated":
        idx[1] = idx[0]
    else:
        idx[0], idx[1] = idx[1], idx[0]
    with pytest.raises(ValueError, match="topk index"):
        q.dequantize(idx.astype("<u2").tobytes() + values[24:], scales, "topk", x.size, 16)


def test_topk_block_size_is_bounded_by_its_index_width() -> None:
    with pytest.raises(ValueError, match="at most"):
        q.quantize(np.zeros(10, np.float32), "topk", q.TOPK_MAX_BLOCK + 1)


def test_int2_has_no_bias_from_zeros_or_ties() -> None:
    """No zero level: exact zeros alternate between -s/3 and +s/3 (their sum is 0, not n·s/3), and a
    value halfway between two levels goes away from zero on either side."""
    x = np.zeros(64, dtype=np.float32)
    x[0], x[1] = 3.0, -3.0
    x[2], x[3] = 2.0, -2.0  # 2/3 of the scale: halfway between 1/3 and 1
    values, scales = q.quantize(x, "int2", 64)
    out = q.dequantize(values, scales, "int2", 64, 64)
    assert out[2] == -out[3] == 3.0
    zeros = out[4:]
    assert set(np.unique(np.abs(zeros))) == {np.float32(1.0)}
    assert float(zeros.sum()) == 0.0
    assert float(out.sum()) == 0.0  # a symmetric input sums to 0 after the round trip


@pytest.mark.parametrize(
    ("n", "block_size"),
    [(1, 8), (7, 8), (259, 256), (70_001, 256), (200_003, 1 << 17), (140_001, 9), (140_000, 65_537)],
)
def test_int4_decodes_to_its_levels_times_the_block_scale_bit_for_bit(n: int, block_size: int) -> None:
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 1e3], n)).astype(np.float32)
    x[n // 2] = np.nan  # a block with a NaN scale decodes to NaN
    values, scales = q.quantize(x, "int4", block_size)
    packed = np.frombuffer(values, np.uint8)
    codes = np.stack([packed & 0x0F, packed >> 4], axis=1).reshape(-1)[:n]
    levels = ((codes.astype(np.float32) - 8) / np.float32(7)).astype(np.float32)
    expected = levels * np.repeat(np.frombuffer(scales, "<f4"), block_size)[:n]
    got = q.dequantize(values, scales, "int4", n, block_size)
    assert (got.dtype, got.shape) == (np.float32, (n,))
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("quantizer", ["int8", "int4", "e3m0", "int2", "int1"])
@pytest.mark.parametrize("block_size", [128, 37])
def test_a_long_array_is_quantized_chunk_by_chunk_to_the_bytes_of_one_piece(
    quantizer: str, block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many chunks (an odd block size, a partial last block, zeros at odd and even positions and a
    non-finite block far from the first chunk) give the bytes the whole array gives at once."""
    x = np.random.default_rng(3).standard_normal(3 * (1 << 18) + 1001).astype(np.float32)
    x[[600_001, 600_002, 700_000]] = 0.0
    x[650_000 : 650_000 + 3 * block_size] = 0.0  # whole blocks of zeros
    x[500_000] = np.inf
    chunked = q.quantize(x, quantizer, block_size)
    monkeypatch.setattr(q, "_CHUNK_VALUES", 1 << 30)
    assert q.quantize(x, quantizer, block_size) == chunked


@pytest.mark.parametrize("quantizer", ["int8", "int4"])
@pytest.mark.parametrize("block_size", [8, 256, 1000])
def test_int8_and_int4_codes_are_the_rounded_scaled_values_of_the_documented_rule(
    quantizer: str, block_size: int
) -> None:
    """``round(x / s * Q)`` clipped to [-Q, Q] (plus 8 for int4), value by value with each block's
    largest magnitude as ``s``: zeros and -0, ties, subnormal and large scales included."""
    rng = np.random.default_rng(7)
    n = 5 * block_size + 3  # a partial last block
    parts = [
        rng.standard_normal(n).astype(np.float32),
        np.where(rng.random(n) < 0.3, np.float32(0.0), np.float32(-0.0)).astype(np.float32),
        (rng.integers(-14, 15, n) / np.float32(2)).astype(np.float32),  # halves: ties once scaled
        rng.standard_normal(n).astype(np.float32) * np.float32(1e-42),
        rng.standard_normal(n).astype(np.float32) * np.float32(1e37),  # finite, near the largest float32
    ]
    levels = 127 if quantizer == "int8" else 7
    for x in parts:
        codes, scales = q.quantize(x, quantizer, block_size)
        s = np.frombuffer(scales, "<f4")
        per_value = np.repeat(s, block_size)[:n]
        safe = np.where(per_value > 0, per_value, np.float32(1))
        expected = np.clip(np.rint(x / safe * np.float32(levels)), -levels, levels).astype(np.int16)
        if quantizer == "int8":
            got = np.frombuffer(codes, np.int8)[:n].astype(np.int16)
        else:
            packed = np.frombuffer(codes, np.uint8)
            got = np.stack([packed & 0x0F, packed >> 4], axis=1).reshape(-1)[:n].astype(np.int16) - 8
        np.testing.assert_array_equal(got, expected)
