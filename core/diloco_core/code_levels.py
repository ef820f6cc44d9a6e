"""Decoding the blocked low-bit formats (``int8``, ``int4``, ``e3m0``, ``int2``, ``int1``) a few
blocks at a time.

Each byte of codes is looked up whole in a table of the levels of the values it packs (for a block
scale of 1), then the levels are multiplied by their block's scale. The result is bit for bit that
of each format's formula applied value by value (``levels``, with every block's scale repeated
over its values): a level is the same float32 whichever way it is made, and each value is one
float32 product of its level and its block's factor. The output is the only array the size of the
tensor: no per-value copy of the scales and no full-size temporaries, which a large fragment would
otherwise make several times over (freshly allocated memory is the slow part of a decode).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import cache

import numpy as np
import numpy.typing as npt

from diloco_core import code_kernels, compiled

F32 = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]

BITS = {"int8": 8, "int4": 4, "e3m0": 4, "int2": 2, "int1": 1}

# value of each 4-bit code for a block scale of 1
INT4_LEVELS: F32 = ((np.arange(16, dtype=np.float32) - 8) / np.float32(7)).astype(np.float32)
E3M0_LEVELS: F32 = np.array(
    [(-1.0 if c & 8 else 1.0) * (2.0 ** ((c & 7) - 7) if c & 7 else 0.0) for c in range(16)], dtype=np.float32
)
_CHUNK = 1 << 16  # values decoded at a time (rounded to whole blocks and whole bytes): they stay in the cache


def levels(quantizer: str, codes: U8) -> F32:
    """The level of each code for a block scale of 1, by each format's formula
    (docs/algorithm.md §3.9); ``int8``'s level is its code, its factor ``scale / 127``."""
    if quantizer == "int8":
        return codes.view(np.int8).astype(np.float32)
    if quantizer == "int4":
        return INT4_LEVELS[codes]
    if quantizer == "e3m0":
        return E3M0_LEVELS[codes]
    if quantizer == "int2":
        return (codes.astype(np.float32) * np.float32(2) - np.float32(3)) / np.float32(3)
    if quantizer == "int1":
        return np.where(codes == 1, np.float32(-1), np.float32(1)).astype(np.float32)
    raise ValueError(f"not a blocked quantizer with codes: {quantizer!r}")


def factors(quantizer: str, scales: F32) -> F32:
    """What each block's levels are multiplied by: its scale (``scale / 127`` for ``int8``)."""
    return scales / np.float32(127) if quantizer == "int8" else scales


@cache
def byte_table(quantizer: str) -> npt.NDArray[np.void]:
    """For each of the 256 bytes, the levels of the codes it packs (the first value in the lowest
    bits), as one item of ``4 * 8 / bits`` bytes: a lookup copies a byte's float32 levels at once."""
    bits = BITS[quantizer]
    per, mask = 8 // bits, np.uint8((1 << bits) - 1)
    byte = np.arange(256, dtype=np.uint8)
    codes = np.stack([(byte >> np.uint8(i * bits)) & mask for i in range(per)], axis=1)
    table = np.ascontiguousarray(levels(quantizer, codes.reshape(-1)).reshape(256, per))
    return table.view(np.dtype((np.void, 4 * per))).reshape(256)


@cache
def level_table(quantizer: str) -> F32:
    """The level of each of the ``2**bits`` codes for a block scale of 1 (``levels`` of every code)."""
    return levels(quantizer, np.arange(1 << BITS[quantizer], dtype=np.uint8))


def decode(values: bytes | memoryview, scales: F32, quantizer: str, n: int, block_size: int) -> F32:
    """The ``n`` float32 values of ``quantizer``'s codes ``values`` in blocks of ``block_size`` with
    ``scales`` (one per block, the last block possibly partial); the byte lengths must already have
    been checked."""
    out = np.empty(n, dtype=np.float32)
    if not _compiled(code_kernels.WRITE, out, _ONE, values, scales, quantizer, block_size):
        for _ in _decoded(values, scales, quantizer, n, block_size, out):
            pass
    return out


def add_decoded(
    acc: F32,
    factor: np.float32,
    values: bytes | memoryview,
    scales: F32,
    quantizer: str,
    n: int,
    block_size: int,
) -> None:
    """``acc += decode(...) * factor``, each product rounded to float32 and then added, bit for bit
    as those two operations on whole arrays give it; the values are decoded a chunk at a time into
    a scratch that stays in the cache, so no array the size of the tensor is made (``acc``: ``n``
    contiguous float32 values)."""
    scaled = factor != 1  # a product with 1 is the value itself, bit for bit
    mode = code_kernels.ADD_SCALED if scaled else code_kernels.ADD
    if acc.ndim == 1 and _compiled(mode, acc[:n], np.float32(factor), values, scales, quantizer, block_size):
        return
    for start, chunk in _decoded(values, scales, quantizer, n, block_size, None):
        if scaled:
            np.multiply(chunk, factor, out=chunk)
        part = acc[start : start + chunk.size]
        np.add(part, chunk, out=part)


_ONE = np.float32(1)


def _compiled(
    mode: int,
    out: F32,
    factor: np.float32,
    values: bytes | memoryview,
    scales: F32,
    quantizer: str,
    block_size: int,
) -> bool:
    """``out`` decoded into by ``mode`` in the compiled loop (``code_kernels``), when it is ready for
    these arrays; False when it is not (the caller runs the numpy code)."""
    if not out.flags.c_contiguous or out.dtype != np.float32:
        return False
    bits = BITS[quantizer]
    kernel = compiled.loop(code_kernels.decoder(quantizer, bits, mode), out.size)
    if kernel is None:
        return False
    packed = compiled.read_only(np.frombuffer(values, dtype=np.uint8))
    f = np.require(factors(quantizer, scales), np.float32, ["C", "W"])
    if packed.size * 8 < out.size * bits or f.size * block_size < out.size:  # the loop checks no bounds
        raise ValueError(
            f"{out.size} values need more codes or scales than the {packed.size} and {f.size} given"
        )
    kernel(out, factor, packed, f, level_table(quantizer), block_size)
    return True


def _decoded(
    values: bytes | memoryview, scales: F32, quantizer: str, n: int, block_size: int, out: F32 | None
) -> Iterator[tuple[int, F32]]:
    """The decoded values a chunk at a time, ``(offset, chunk)``: each chunk in its place in ``out``,
    or without ``out`` in one scratch array reused for every chunk (valid until the next)."""
    per = 8 // BITS[quantizer]
    table = byte_table(quantizer)
    f = factors(quantizer, scales)
    packed = np.frombuffer(values, dtype=np.uint8)
    whole_bytes_of_blocks = block_size * per // math.gcd(block_size, per)
    chunk = max(1, _CHUNK // whole_bytes_of_blocks) * whole_bytes_of_blocks
    index = np.empty(chunk // per, dtype=np.intp)  # the bytes as take's indices, made once
    scratch = np.empty(min(chunk, n), dtype=np.float32) if out is None else out
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        first_byte = start // per
        o = out[start : start + m] if out is not None else scratch[:m]
        if m % per == 0:
            i = index[: m // per]
            np.copyto(i, packed[first_byte : first_byte + m // per])
            np.take(table, i, out=o.view(table.dtype), mode="clip")
        else:  # the tensor's last byte holds fewer values than it has room for
            o[:] = table[packed[first_byte : first_byte + -(-m // per)]].view(np.float32)[:m]
        first, whole = start // block_size, m // block_size
        blocks = o[: whole * block_size].reshape(whole, block_size)
        np.multiply(blocks, f[first : first + whole, None], out=blocks)
        if whole * block_size < m:
            o[whole * block_size :] *= f[first + whole]
        yield start, o
