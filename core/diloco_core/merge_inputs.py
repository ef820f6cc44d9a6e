"""Contributions as a round merges them (``screening``): scaled down to their norm limit, or taken
whole with their norm measured as the merge reads them."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from diloco_core.code_norms import array_sum_squares, norm_of_sums
from diloco_core.merge import scaled
from diloco_core.quantized_arrays import QuantizedArrays
from diloco_core.round_math import MergeInput


class _Over(Mapping[str, npt.NDArray[np.floating]]):
    """A contribution's tensors, read through this mapping (its names and count are theirs)."""

    def __init__(self, tensors: Mapping[str, npt.NDArray[np.floating]]) -> None:
        self._tensors = tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


class ScaledTensors(_Over):
    """A contribution's tensors times ``scale``, each read (and decoded) when the merge asks for it;
    multiplied as ``scaled`` does."""

    def __init__(self, tensors: Mapping[str, npt.NDArray[np.floating]], scale: float) -> None:
        super().__init__(tensors)
        self._scale = scale

    def __getitem__(self, name: str) -> npt.NDArray[np.float32]:
        return scaled(np.asarray(self._tensors[name], dtype=np.float32), self._scale)


@dataclass(frozen=True)
class _Claims:
    """A contribution's claims (``of``'s), for one merged with other tensors than its own."""

    of: MergeInput

    @property
    def base_version(self) -> int:
        return self.of.base_version

    @property
    def steps(self) -> int:
        return self.of.steps

    @property
    def tokens(self) -> int:
        return self.of.tokens


@dataclass(frozen=True)
class Clipped(_Claims):
    """A contribution merged at ``scale`` times its outer gradient, with its own claims."""

    scale: float

    @property
    def tensors(self) -> Mapping[str, npt.NDArray[np.floating]]:
        return ScaledTensors(self.of.tensors, self.scale)


class MeasuredTensors(_Over):
    """A contribution's tensors, each one's sum of squares recorded as the merge reads it."""

    def __init__(self, tensors: Mapping[str, npt.NDArray[np.floating]]) -> None:
        super().__init__(tensors)
        self._sums: dict[str, float] = {}

    def __getitem__(self, name: str) -> npt.NDArray[np.floating]:
        value = self._tensors[name]
        self._sums[name] = array_sum_squares(np.asarray(value))
        return value

    def norm(self) -> float | None:
        """``tensors_norm`` of the tensors from what was read (None until every tensor was read)."""
        if set(self._sums) != set(self._tensors):
            return None
        return norm_of_sums(self._sums[name] for name in sorted(self._tensors))


@dataclass(frozen=True)
class Measured(_Claims):
    """A contribution merged whole, its norm measured as it is read."""

    tensors: MeasuredTensors


def unmeasured(c: MergeInput) -> bool:
    """Whether a contribution's norm is found by reading its values: it carries none, and its
    tensors are not read from their codes (``QuantizedArrays``)."""
    return not isinstance(getattr(c, "norm", None), float) and not isinstance(c.tensors, QuantizedArrays)


def as_merged(c: MergeInput, norm: float, limit: float) -> MergeInput:
    """The contribution as the round merges it: itself, or scaled down to ``limit``."""
    return c if norm <= limit else Clipped(c, limit / norm)
