"""A payload's tensors as they came (decompressed, still quantized), each decoded only when read."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
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

    def __getitem__(self, name: str) -> npt.NDArray[np.float32]:
        return self._read(name, q.dequantize).reshape(self._specs[name][0])

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

    def sum_squares(self, name: str) -> float:
        """The sum of squares of tensor ``name``'s values in float64 (``inf`` when one is not
        finite), from its codes where the format allows (``code_norms.sum_squares``)."""
        return self._read(name, sum_squares)

    def _read(self, name: str, read: Callable[[memoryview, memoryview, str, int, int], T]) -> T:
        """``read(values, scales, quantizer, n, block_size)`` of tensor ``name``; a malformed tensor
        raises ``CorruptPayload`` (only topk's indices can be, once the layout is checked)."""
        shape, (vo, vn), (so, sn) = self._specs[name]
        data = self._data
        try:
            return read(data[vo : vo + vn], data[so : so + sn], self._quantizer, prod(shape), self._block)
        except ValueError as exc:
            raise CorruptPayload(f"tensor {name!r}: {exc}") from exc
