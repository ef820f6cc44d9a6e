"""The wire quantizers of ``diloco_core.quantize`` in torch, on any device, byte for byte the same.

``diloco_core.quantize`` (numpy) is the reference and the definition of every format; this module
writes the same bytes from tensors where they live (a GPU), so that a learner quantizes its outer
gradient without copying float32 values to the host first. Every step is one that IEEE float32
arithmetic defines exactly (a true division by a tensor, never by a scalar, which torch may turn
into a multiplication by a reciprocal; a multiplication; round half to even; exact comparisons
with ``E3M0_THRESHOLDS`` instead of a logarithm), so CPU and CUDA kernels agree with numpy.

A fragment is quantized in one go from a flat **layout**: its tensors one after the other, each
starting at an even multiple of the block size and padded with zeros up to the next tensor. The
blocks of the flat buffer are then exactly the blocks each tensor has on its own (plus all-zero
ones in the padding, left out), and each tensor's values and scales are contiguous slices of the
results (``FlatLayout.parts``), ready for ``codec.encode_quantized``.

Bytes are written in the host's order, which must be little-endian (as the wire format is).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from diloco_core import code_levels
from diloco_core import quantize as q
from diloco_core.byte_planes import Planes
from diloco_core.codec import QuantizedTensor
from diloco_core.fragments import TensorSpec
from torch import Tensor

if sys.byteorder != "little":  # pragma: no cover - every platform PyTorch ships for is little-endian
    raise ImportError("diloco_worker.torch_quantize writes the little-endian wire format in host order")

_VALUE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}
_CODE_BITS = {"int4": 4, "e3m0": 4, "int2": 2}  # packed codes: 8 // bits per byte, the first lowest
# the formats with a torch implementation; the others (int1, topk) are quantized by the numpy
# reference (``anchors.DeviceAnchors.outer_gradient`` hands over host arrays)
FORMATS: tuple[str, ...] = ("fp32", "bf16", "fp16", "int8", "int4", "e3m0", "int2")


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a fragment lies in a flat float32 buffer: block-aligned, zero-padded."""

    specs: tuple[TensorSpec, ...]
    offsets: tuple[int, ...]  # element offset of each tensor: an even multiple of block_size
    total: int  # elements of the buffer, an even multiple of block_size
    block_size: int

    @classmethod
    def of(cls, specs: Sequence[TensorSpec], block_size: int = q.DEFAULT_BLOCK_SIZE) -> FlatLayout:
        if not q.MIN_BLOCK_SIZE <= block_size <= q.MAX_BLOCK_SIZE:
            raise ValueError(
                f"block_size must be in [{q.MIN_BLOCK_SIZE}, {q.MAX_BLOCK_SIZE}], got {block_size}"
            )
        # offsets that are multiples of 4 keep the packed 4-bit and 2-bit codes of one tensor in
        # bytes of its own, whatever the block size
        align = math.lcm(block_size, 4)
        offsets, pos = [], 0
        for spec in specs:
            offsets.append(pos)
            pos += -(-spec.numel // align) * align
        return cls(tuple(specs), tuple(offsets), pos, block_size)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    @property
    def numel(self) -> int:
        """Values of the tensors (without the padding)."""
        return sum(s.numel for s in self.specs)

    def views(self, flat: Tensor) -> list[Tensor]:
        """Each tensor's region of ``flat``, in its shape (views: writing them writes ``flat``)."""
        return [flat[o : o + s.numel].view(s.shape) for s, o in zip(self.specs, self.offsets, strict=True)]

    def tail_pads(self, per_byte: int) -> list[int]:
        """The padding positions that share a byte with a tensor's last packed code (``per_byte``
        codes to a byte): the reference packs zero codes there, where the padding's own codes could
        differ (int4's zero is 8, int2 has none)."""
        return [
            i
            for s, o in zip(self.specs, self.offsets, strict=True)
            for i in range(o + s.numel, o + -(-s.numel // per_byte) * per_byte)
        ]

    def parts(self, quantizer: str, values: np.ndarray, scales: np.ndarray) -> dict[str, QuantizedTensor]:
        """Each tensor's slices of a quantized flat buffer (``values`` and ``scales`` as uint8 host
        arrays, as ``quantize_flat`` returns them), for ``codec.encode_quantized``. No copies."""
        out: dict[str, QuantizedTensor] = {}
        vmem, smem = values.data.cast("B"), scales.data.cast("B")
        for spec, offset in zip(self.specs, self.offsets, strict=True):
            vstart = (
                offset * _VALUE_BYTES[quantizer]
                if quantizer in _VALUE_BYTES
                else offset * _CODE_BITS[quantizer] // 8
            )
            sstart = 4 * (offset // self.block_size) if quantizer in q.BLOCKED else 0
            nv = q.data_nbytes(quantizer, spec.numel)
            ns = q.scales_nbytes(quantizer, spec.numel, self.block_size)
            out[spec.name] = QuantizedTensor(
                spec.shape, vmem[vstart : vstart + nv], smem[sstart : sstart + ns]
            )
        return out


@dataclass(frozen=True)
class QuantizedFlat:
    """A flat buffer in a quantizer's format: values and block scales as uint8 tensors (little-endian)."""

    values: Tensor
    scales: Tensor


def quantize_flat(flat: Tensor, quantizer: str, layout: FlatLayout) -> QuantizedFlat:
    """Quantize a flat float32 buffer laid out as ``layout`` (padding zero) on its own device."""
    if flat.dtype != torch.float32 or flat.dim() != 1 or flat.numel() != layout.total:
        raise ValueError(
            f"expected a flat float32 buffer of {layout.total} values, got {flat.dtype} {tuple(flat.shape)}"
        )
    empty = torch.empty(0, dtype=torch.uint8, device=flat.device)
    if quantizer == "fp32":
        return QuantizedFlat(flat.view(torch.uint8), empty)
    if quantizer == "fp16":
        return QuantizedFlat(_u16_bytes(_fp16_bits(flat)), empty)
    if quantizer == "bf16":
        return QuantizedFlat(_u16_bytes(_bf16_bits(flat)), empty)
    if quantizer not in FORMATS:
        raise ValueError(f"no torch implementation of quantizer {quantizer!r}; one of {FORMATS}")
    blocks = flat.view(-1, layout.block_size)
    scales = blocks.abs().amax(dim=1)
    bad = ~torch.isfinite(scales)  # the block holds a NaN or an infinity: written canonically
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))[:, None]
    if quantizer == "e3m0":
        codes = _e3m0_codes(blocks, safe)
    elif quantizer == "int2":
        codes = _int2_codes(blocks, safe, scales)
    else:
        top = 127 if quantizer == "int8" else 7
        r = torch.div(blocks, safe)
        r.mul_(top).round_().clamp_(-top, top).masked_fill_(bad[:, None], 0)
        if quantizer == "int4":
            r.add_(8)
        codes = r.to(torch.int8 if quantizer == "int8" else torch.uint8)
    codes = codes.masked_fill_(bad[:, None], q.ZERO_CODE[quantizer]).view(-1)
    nan_bits = torch.full_like(scales.view(torch.int32), q.CANONICAL_NAN_BITS)
    scale_bytes = torch.where(bad, nan_bits, scales.view(torch.int32)).view(torch.uint8)
    if quantizer == "int8":
        return QuantizedFlat(codes.view(torch.uint8), scale_bytes)
    bits = _CODE_BITS[quantizer]
    if layout.tail_pads(8 // bits):
        codes.index_fill_(0, _pad_index(layout, 8 // bits, flat.device), 0)
    return QuantizedFlat(_pack(codes, bits), scale_bytes)


def _pack(codes: Tensor, bits: int) -> Tensor:
    """``8 // bits`` codes to a byte, the first in the lowest bits (the reference's order)."""
    groups = codes.view(-1, 8 // bits)
    out = groups[:, 0].clone()
    for i in range(1, 8 // bits):
        out |= groups[:, i] << (i * bits)
    return out


def _unpack(values: Tensor, bits: int, n: int) -> Tensor:
    mask = (1 << bits) - 1
    return torch.stack([(values >> (i * bits)) & mask for i in range(8 // bits)], dim=1).view(-1)[:n]


def _int2_codes(blocks: Tensor, safe: Tensor, scales: Tensor) -> Tensor:
    """The reference's int2 levels (``diloco_core.quantize._int2_codes``): the nearest of
    ``{-1.5, -0.5, 0.5, 1.5}`` after scaling by 1.5 / s, halfway values away from zero, an exact 0
    negative at an even position and positive at an odd one (the layout's offsets are even, so a
    position's parity in the flat buffer is its parity in its tensor), a block of zeros positive."""
    y = torch.div(blocks, safe).mul_(1.5)
    outer = (y.abs() >= 1).to(torch.uint8)
    positive = y > 0
    zero_odd = (y == 0).view(-1)[1::2]
    positive.view(-1)[1::2] |= zero_odd
    positive |= (scales == 0)[:, None]
    return torch.where(positive, outer + 2, 1 - outer)


def _e3m0_codes(blocks: Tensor, safe: Tensor) -> Tensor:
    mag = torch.div(blocks.abs(), safe)
    thresholds = _table("e3m0_thresholds", blocks.device)
    level = torch.bucketize(mag, thresholds, out_int32=True, right=True).to(torch.uint8)
    sign = (torch.signbit(blocks) & (level > 0)).to(torch.uint8) << 3
    return sign | level


def _fp16_bits(x: Tensor) -> Tensor:
    """int32 holding the 16 bits numpy's reference writes (a NaN made quiet, sign and payload top kept)."""
    half = x.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    bits = x.view(torch.int32)
    nan = ((bits >> 16) & 0x8000) | 0x7E00 | ((bits >> 13) & 0x3FF)
    return torch.where(torch.isnan(x), nan, half)


def _bf16_bits(x: Tensor) -> Tensor:
    """int32 holding the reference's bfloat16 bits: round to nearest even, NaN made quiet."""
    isnan = torch.isnan(x)
    bits = x.view(torch.int32)
    finite = torch.where(isnan, torch.zeros_like(bits), bits)  # no NaN reaches the carry below
    rounded = ((finite + 0x7FFF + ((finite >> 16) & 1)) >> 16) & 0xFFFF
    return torch.where(isnan, ((bits >> 16) & 0xFFFF) | 0x0040, rounded)


def _u16_bytes(v: Tensor) -> Tensor:
    """Values in [0, 65535] (int32) as little-endian uint16 bytes."""
    return torch.where(v >= 0x8000, v - 0x10000, v).to(torch.int16).view(torch.uint8)


def quantize(x: Tensor, quantizer: str, block_size: int = q.DEFAULT_BLOCK_SIZE) -> tuple[bytes, bytes]:
    """One tensor, as ``diloco_core.quantize.quantize`` does (the same two byte strings)."""
    layout = FlatLayout.of([TensorSpec("x", tuple(x.shape))], block_size)
    flat = torch.zeros(layout.total, dtype=torch.float32, device=x.device)
    flat[: x.numel()] = x.detach().reshape(-1).to(torch.float32)
    out = quantize_flat(flat, quantizer, layout)
    part = layout.parts(quantizer, out.values.cpu().numpy(), out.scales.cpu().numpy())["x"]
    assert not isinstance(part.values, Planes)  # slices of the flat buffer
    return bytes(part.values), bytes(part.scales)


# the reference's constant tables: thresholds, and the value of each 4-bit code for a scale of 1
_TABLES = {
    "e3m0_thresholds": q.E3M0_THRESHOLDS,
    "int4": code_levels.INT4_LEVELS,
    "e3m0": code_levels.E3M0_LEVELS,
}


@functools.lru_cache(maxsize=32)
def _table(name: str, device: torch.device) -> Tensor:
    """A constant table on ``device``, copied there once (a copy from pageable host memory would
    wait for the device at every call)."""
    return torch.from_numpy(_TABLES[name].copy()).to(device)


@functools.lru_cache(maxsize=256)
def _pad_index(layout: FlatLayout, per_byte: int, device: torch.device) -> Tensor:
    return torch.tensor(layout.tail_pads(per_byte), dtype=torch.long).to(device)


def dequantize(values: Tensor, scales: Tensor, quantizer: str, n: int, block_size: int) -> Tensor:
    """Inverse of the quantizers, as ``diloco_core.quantize.dequantize``: ``values`` and ``scales``
    are uint8 tensors on any device (byte lengths already checked); float32 of ``n`` values."""
    if quantizer == "fp32":
        return values.view(torch.float32)[:n].clone()
    if quantizer == "fp16":
        return values.view(torch.float16)[:n].to(torch.float32)
    if quantizer == "bf16":
        return ((values.view(torch.int16)[:n].to(torch.int32) & 0xFFFF) << 16).view(torch.float32)
    if quantizer not in FORMATS:
        raise ValueError(f"no torch implementation of quantizer {quantizer!r}; one of {FORMATS}")
    per_value = scales.view(torch.float32).repeat_interleave(block_size)[:n]
    if quantizer == "int8":
        return values.view(torch.int8)[:n].to(torch.float32) * torch.div(per_value, _scalar(127.0, values))
    if quantizer == "int2":
        codes2 = _unpack(values, 2, n).to(torch.float32)
        return torch.div(codes2 * 2 - 3, _scalar(3.0, values)) * per_value
    levels = _table(quantizer, values.device)
    return levels[_unpack(values, 4, n).long()] * per_value


def _scalar(value: float, like: Tensor) -> Tensor:
    """A float32 scalar on ``like``'s device: dividing by it is a true division (torch turns a
    division by a host scalar into a multiplication by its reciprocal on CUDA)."""
    return torch.full((), value, dtype=torch.float32, device=like.device)
