"""The torch quantizers write exactly the bytes of the numpy reference, for every format, shape,
block size and block remainder, including NaN payloads, infinities, subnormals and signed zeros."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diloco_core import codec
from diloco_core import quantize as q
from diloco_core.fragments import TensorSpec
from diloco_worker import torch_quantize as tq
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

QUANTIZERS = list(tq.FORMATS)
MAX_VALUES = 700


@st.composite
def float32_values(draw: st.DrawFn, max_size: int = MAX_VALUES) -> np.ndarray:
    """Any float32 bit pattern, hypothesis' own floats, or scaled normal values (many distinct codes
    per block, the common case)."""
    n = draw(st.integers(0, max_size))
    kind = draw(st.sampled_from(["bits", "floats", "normal"]))
    if kind == "bits":
        return draw(hnp.arrays(np.uint32, n, elements=st.integers(0, 2**32 - 1))).view(np.float32)
    if kind == "floats":
        return draw(hnp.arrays(np.float32, n, elements=st.floats(width=32)))
    seed, scale = draw(st.integers(0, 2**32 - 1)), draw(st.floats(1e-30, 1e30))
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


block_sizes = st.one_of(st.sampled_from([8, 9, 16, 32, 256]), st.integers(q.MIN_BLOCK_SIZE, 300))


@pytest.mark.parametrize("quantizer", QUANTIZERS)
@settings(max_examples=150, deadline=None)
@given(x=float32_values(), block_size=block_sizes)
def test_one_tensor_quantizes_to_the_reference_bytes(quantizer: str, x: np.ndarray, block_size: int) -> None:
    expected = q.quantize(x, quantizer, block_size)
    assert tq.quantize(torch.from_numpy(x.copy()), quantizer, block_size) == expected


@pytest.mark.parametrize("quantizer", QUANTIZERS)
@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(
        hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=13), min_size=1, max_size=5
    ),
    block_size=block_sizes,
    seed=st.integers(0, 2**32 - 1),
    special=st.sampled_from([None, np.nan, np.inf, -np.inf, 0.0, 7e4]),
)
def test_a_fragment_in_one_flat_buffer_encodes_to_the_reference_payload(
    quantizer: str, shapes: list[tuple[int, ...]], block_size: int, seed: int, special: float | None
) -> None:
    """Several tensors laid out in one buffer (block-aligned, zero-padded) give the payload that
    ``codec.encode`` writes for the tensors one by one."""
    rng = np.random.default_rng(seed)
    arrays = {f"t{i}.weight": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
    if special is not None:
        for a in arrays.values():
            if a.size:
                a.reshape(-1)[rng.integers(a.size)] = special
    layout = tq.FlatLayout.of([TensorSpec(n, a.shape) for n, a in arrays.items()], block_size)
    flat = torch.zeros(layout.total)
    for view, name in zip(layout.views(flat), layout.names, strict=True):
        view.copy_(torch.from_numpy(arrays[name]))
    out = tq.quantize_flat(flat, quantizer, layout)
    parts = layout.parts(quantizer, out.values.numpy(), out.scales.numpy())
    args = {
        "fragment": 3,
        "base_version": 5,
        "kind": "outer_grad",
        "quantizer": quantizer,
        "block_size": block_size,
    }
    assert codec.encode_quantized(parts, **args) == codec.encode(arrays, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("quantizer", QUANTIZERS)
@settings(max_examples=80, deadline=None)
@given(x=float32_values(), block_size=block_sizes)
def test_dequantizing_gives_the_reference_floats(quantizer: str, x: np.ndarray, block_size: int) -> None:
    values, scales = q.quantize(x, quantizer, block_size)
    expected = q.dequantize(values, scales, quantizer, x.size, block_size)

    def as_tensor(b: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)

    got = tq.dequantize(as_tensor(values), as_tensor(scales), quantizer, x.size, block_size).numpy()
    assert got.dtype == np.float32
    # NaNs compare by position (their payload is not part of any contract), everything else by bits
    assert np.array_equal(np.isnan(got), np.isnan(expected))
    finite = ~np.isnan(expected)
    assert np.array_equal(got[finite].view(np.uint32), expected[finite].view(np.uint32))


def test_e3m0_levels_around_every_threshold_match_the_reference() -> None:
    """Every float32 within 3000 ulps of each level boundary, in one block of scale 1."""
    around = [
        np.arange(int(t.view(np.uint32)) - 3000, int(t.view(np.uint32)) + 3000, dtype=np.uint32)
        for t in q.E3M0_THRESHOLDS
    ]
    x = np.concatenate([np.array([1.0], np.float32), *(a.view(np.float32) for a in around)])
    x[1::2] *= -1
    assert tq.quantize(torch.from_numpy(x), "e3m0", x.size) == q.quantize(x, "e3m0", x.size)


def test_layout_aligns_tensors_to_blocks_at_multiples_of_four_and_pads_with_zeros() -> None:
    layout = tq.FlatLayout.of([TensorSpec("a", (3, 5)), TensorSpec("b", (0,)), TensorSpec("c", (9,))], 9)
    assert layout.offsets == (0, 36, 36)
    assert layout.total == 72
    assert layout.tail_pads(2) == [15, 45]
    assert layout.tail_pads(4) == [15, 45, 46, 47]
    assert layout.numel == 24
    assert tq.FlatLayout.of([TensorSpec("a", (300,))], 256).total == 512  # the default: whole blocks


def test_a_buffer_that_does_not_match_the_layout_is_refused() -> None:
    layout = tq.FlatLayout.of([TensorSpec("a", (4,))], 8)
    with pytest.raises(ValueError, match="flat float32 buffer of 8"):
        tq.quantize_flat(torch.zeros(4), "int8", layout)
    with pytest.raises(ValueError, match="no torch implementation"):
        tq.quantize_flat(torch.zeros(8), "int1", layout)


@pytest.mark.gpu
@pytest.mark.parametrize("quantizer", QUANTIZERS)
@settings(max_examples=100, deadline=None)
@given(x=float32_values(), block_size=block_sizes)
def test_cuda_kernels_write_the_reference_bytes(quantizer: str, x: np.ndarray, block_size: int) -> None:
    expected = q.quantize(x, quantizer, block_size)
    assert tq.quantize(torch.from_numpy(x.copy()).cuda(), quantizer, block_size) == expected


@pytest.mark.gpu
@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_cuda_kernels_write_the_reference_bytes_for_a_large_fragment(quantizer: str) -> None:
    """A few million values: the vectorised and tail paths of the kernels, many blocks."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(3_000_001) * rng.lognormal(0, 4, 3_000_001)).astype(np.float32)
    assert tq.quantize(torch.from_numpy(x).cuda(), quantizer) == q.quantize(
        x, quantizer, q.DEFAULT_BLOCK_SIZE
    )
