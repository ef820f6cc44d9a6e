"""``fp32-planes``: float32 values as they are, each run of values written as its four byte planes.

A float32 of a model's weights or of its optimizer state spends its high byte (the sign and seven
bits of the exponent) on a few dozen values and its three low bytes on what is nearly noise. Written
as they lie, the four bytes alternate, and zstd at level 1 finds 7.6 % to save in a payload of
random normal float32. Written as planes, the high bytes of a run come together and compress by
their byte frequencies to about a third, and the three low planes pass as they are: 16.6 % is
saved (docs/benchmarks.md, "Whole versions in byte planes"), with less work, since the match
search has little to look for.

The layout: the values in runs of ``RUN`` (the last run holds the rest); a run of m values is m
bytes of the values' byte 3 (the high byte of the little-endian float32), then m of byte 2, m of
byte 1 and m of byte 0. Lossless, bit for bit (NaN payloads and -0 included), 4 bytes per value,
no scales. The frame that carries it ends a zstd block where each run's high plane ends and where
the run ends (``diloco_core.payload_frame``), so that the high planes are entropy-coded in blocks of
their own (the first shares its block with the payload's header) and the low planes go raw.

This is a wire format of whole versions and initial parameters, not a codec a job chooses: it
carries exactly what ``fp32`` carries.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from diloco_core import compiled, plane_kernels

NAME = "fp32-planes"
RUN = 1 << 18  # values per run: a megabyte of float32, rearranged in the cache

F32 = npt.NDArray[np.float32]


class Planes:
    """A float32 array's values in the layout, made a run at a time as a frame reads them: nothing of
    the array's size is made. Holds a reference to the array (a contiguous little-endian view of it
    where it is one), which must not change while it is read."""

    def __init__(self, x: npt.NDArray[np.floating]) -> None:
        self._words = np.ascontiguousarray(x, dtype="<f4").reshape(-1).view("<u4")

    @property
    def nbytes(self) -> int:
        return 4 * int(self._words.size)

    def runs(self) -> Iterator[tuple[memoryview, memoryview]]:
        """Each run as (its high plane, its three other planes), views of one scratch buffer that the
        next run overwrites. A plane is its bytes' 32-bit words shifted right and narrowed to 8 bits
        (the low byte first, then the rest shifted a byte further each time, in a run-sized scratch
        that stays in the cache): contiguous passes, a third less CPU than copying each byte from
        every fourth (docs/benchmarks.md)."""
        n = self._words.size
        scratch = np.empty(4 * min(RUN, n), dtype=np.uint8)
        shifted = np.empty(min(RUN, n), dtype=np.uint32)
        for start in range(0, n, RUN):
            m = min(RUN, n - start)
            planes = scratch[: 4 * m].reshape(4, m)
            rest = self._words[start : start + m]
            for plane in (3, 2, 1, 0):  # byte 0 (the word narrowed), then bytes 1, 2 and 3
                np.copyto(planes[plane], rest, casting="unsafe")
                if plane:
                    rest = np.right_shift(rest, 8, out=shifted[:m])
            flat = scratch[: 4 * m].data
            yield flat[:m], flat[m:]

    def tobytes(self) -> bytes:
        return b"".join(bytes(high) + bytes(rest) for high, rest in self.runs())

    def values(self) -> F32:
        """A float32 copy of the values."""
        return self._words.view("<f4").astype(np.float32)


def decode(data: bytes | memoryview, n: int) -> F32:
    """The ``n`` float32 values of ``4 * n`` bytes in the layout (their length already checked); in
    one pass of the compiled loop once it is ready (``plane_kernels.JOIN``)."""
    packed = np.frombuffer(data, dtype=np.uint8, count=4 * n)
    out = np.empty(n, dtype="<f4")
    join = compiled.loop(plane_kernels.JOIN, n)
    if join is not None:
        join(out.view(np.uint32), compiled.read_only(packed), RUN)
    else:
        _join_planes(packed, out.view(np.uint8), n)
    return out.astype(np.float32, copy=False)


def _join_planes(packed: npt.NDArray[np.uint8], out_bytes: npt.NDArray[np.uint8], n: int) -> None:
    """The numpy join: each plane of a run copied into every fourth byte of its values."""
    for start in range(0, n, RUN):
        m = min(RUN, n - start)
        planes = packed[4 * start : 4 * (start + m)].reshape(4, m)
        values = out_bytes[4 * start : 4 * (start + m)].reshape(m, 4)
        for plane in range(4):
            values[:, 3 - plane] = planes[plane]
