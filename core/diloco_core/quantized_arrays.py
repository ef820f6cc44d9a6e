"""A payload's tensors as they came (decompressed, still quantized), each decoded only when read."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from math import prod
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from diloco_core import quantize as q
from diloco_core.code_norms import sum_squares
from diloco_core.payload_errors import CorruptPayload
from diloco_core.payload_header import Spec

T = TypeVar("T")


class QuantizedArrays(Mapping[str, npt.NDArray[np.float32]]):
    """A payload's tensors kept as they came (decompressed, still quantized), each turned into
    float32 only when it is read: a pending int4 outer gradient holds about half a byte per value
    instead of four. Every read is a new array; a malformed tensor raises ``CorruptPayload``."""

    def __init__(self, data: memoryview, specs: list[Spec], quantizer: str, block_size: int) -> None:
        self._data, self._quantizer, self._block = data, quantizer, block_size
        self._specs = {name: (shape, values, scales) for name, shape, values, scales in specs}
        self._sums: dict[str, float] = {}

    def __getitem__(self, name: str) -> npt.NDArray[np.float32]:
        shape = self._specs[name][0]
        values = self._read(name, q.dequantize)
        try:
            return values.reshape(shape)
        except ValueError as exc:  # a shape numpy makes no array of (``payload_header`` bounds them)
            raise CorruptPayload(f"tensor {name!r}: shape {list(shape)}: {exc}") from exc

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._specs[name][0])

    @property
    def nbytes(self) -> int:
        """The bytes held: the payload's decompressed data."""
        return len(self._data)

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def codes(self, name: str) -> TensorCodes | None:
        """Tensor ``name`` as the merge reads it from its codes, without decoding it whole (None for
        a format that is not decoded a chunk at a time: ``quantize.decodes_in_chunks``)."""
        return TensorCodes(self, name) if q.decodes_in_chunks(self._quantizer) else None

    def add_scaled(self, name: str, acc: npt.NDArray[np.float32], factor: np.float32) -> None:
        """``acc += self[name] * factor`` (``acc`` flat; each product rounded to float32), without
        an array of the tensor's size (``quantize.add_dequantized``)."""
        self._read(name, partial(q.add_dequantized, acc, factor))

    def sum_squares(self, name: str) -> float:
        """The sum of squares of tensor ``name``'s values in float64 (``inf`` when one is not
        finite), from its codes where the format allows (``code_norms.sum_squares``); found once (the
        check on arrival and the round's merge both ask)."""
        if name not in self._sums:
            self._sums[name] = self._read(name, sum_squares)
        return self._sums[name]

    def _read(self, name: str, read: Callable[[memoryview, memoryview, str, int, int], T]) -> T:
        """``read(values, scales, quantizer, n, block_size)`` of tensor ``name``; a malformed tensor
        raises ``CorruptPayload`` (only topk's indices can be, once the layout is checked)."""
        shape, (vo, vn), (so, sn) = self._specs[name]
        data = self._data
        try:
            return read(data[vo : vo + vn], data[so : so + sn], self._quantizer, prod(shape), self._block)
        except ValueError as exc:
            raise CorruptPayload(f"tensor {name!r}: {exc}") from exc


@dataclass(frozen=True)
class TensorCodes:
    """One tensor of a payload read from its codes (``merge.Codes``): its shape, its sum of squares
    and its values added into a sum, each without decoding it whole."""

    arrays: QuantizedArrays
    name: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.arrays.shape(self.name)

    def sum_squares(self) -> float:
        return self.arrays.sum_squares(self.name)

    def add_to(self, acc: npt.NDArray[np.float32], factor: np.float32) -> None:
        self.arrays.add_scaled(self.name, acc, factor)

    def values(self) -> npt.NDArray[np.float32]:
        return self.arrays[self.name]
