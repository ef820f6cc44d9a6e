"""Merging outer gradients of one fragment from several learners (docs/algorithm.md §3.6, §3.7).

Weights are token-weighted (``tokens * tokens / steps``: quantity x quality) with an optional
staleness discount. Tokens and steps are bounded (``diloco_core.bounds``), so a weight is a finite
float64, and the merge uses the weights divided by the largest of them (each in [0, 1]), so neither
their sum nor a weighted value can overflow whatever finite weights it is given. Non-embedding tensors are merged with Radial-Directional Averaging (norms and
directions averaged separately, so the merged norm does not shrink as ``1/sqrt(M)`` with M nearly
orthogonal contributions); embedding fragments with the weighted mean. Sums are float32, in the
order the contributions are given, and running: each contribution's tensor is read (a payload held
quantized is decoded then), added and let go once the next is read, so a merge holds the sum, a
scratch array and two tensors read, whatever the number of contributions. A tensor a payload
holds in a blocked low-bit format is read from its codes (``Codes``): its norm from them, and its
values decoded a chunk at a time into the sum, so no array of its size is made for it.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from diloco_core.bounds import MAX_STEPS, MAX_TOKENS

F32 = npt.NDArray[np.float32]
MergeRule = Literal["rda", "mean"]
TINY_SCALE = 1e-30  # a scale below this is applied in float64 (float32 would lose it below its range)

# The mean direction counts as vanished below this norm (unit directions averaged; 1 is the maximum).
_MIN_DIRECTION_NORM = 1e-6


@runtime_checkable
class Codes(Protocol):
    """A tensor read from its codes (``quantized_arrays.TensorCodes``) instead of as an array."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def sum_squares(self) -> float:
        """Its values' sum of squares in float64 (``inf`` when one is not finite)."""
        ...

    def add_to(self, acc: F32, factor: np.float32) -> None:
        """``acc += values * factor``, each product rounded to float32 (``acc`` flat, float32)."""
        ...

    def values(self) -> F32:
        """Its values, decoded (a new array of its shape)."""
        ...


@runtime_checkable
class FromCodes(Protocol):
    """A contribution's tensors that can be read from their codes (``QuantizedArrays``)."""

    def codes(self, name: str) -> Codes | None: ...


Vector = npt.NDArray[np.floating] | Codes


def contribution_weight(
    tokens: int,
    steps: int,
    *,
    token_weighting: bool = True,
    staleness: int = 0,
    staleness_power: float = 0.0,
) -> float:
    """``tokens * tokens / steps`` (1.0 without token weighting) x ``(1 + staleness) ** -staleness_power``.

    A finite float64 (at most ``MAX_TOKENS ** 2``): tokens or steps beyond their bounds raise
    ``ValueError`` naming the bound instead of overflowing.
    """
    if steps < 1:
        raise ValueError(f"a contribution needs at least one inner step, got steps={steps}")
    if tokens < 0 or staleness < 0 or staleness_power < 0:
        raise ValueError(
            f"tokens, staleness and staleness_power must be >= 0 ({tokens}, {staleness}, {staleness_power})"
        )
    if tokens > MAX_TOKENS or steps > MAX_STEPS:
        raise ValueError(
            f"tokens ({_shown(tokens)}) or steps ({_shown(steps)}) beyond what a learner can report "
            f"(at most {MAX_TOKENS:.0e} tokens and {MAX_STEPS:.0e} steps)"
        )
    base = tokens * tokens / steps if token_weighting else 1.0
    return float(base * (1.0 + staleness) ** -staleness_power)


def _shown(n: int) -> str:
    """An integer for a message, however large (Python will not print one of over 4,300 digits)."""
    return str(n) if n.bit_length() <= 64 else f"a {n.bit_length()}-bit number"


_FINITE_CHUNK = 1 << 16  # values checked at a time: their flags stay in the cache


def check_finite(tensors: Mapping[str, npt.NDArray[np.floating]]) -> str | None:
    """The reason to reject a contribution with NaN or infinite values, or None when all are finite.
    Read a chunk at a time into one small array of flags, so no array of a tensor's size is made."""
    for name in sorted(tensors):
        if not _all_finite(np.asarray(tensors[name])):
            return f"non-finite values in {name!r}"
    return None


def non_finite_reason(tensors: Mapping[str, npt.NDArray[np.floating]], norm: float) -> str | None:
    """``check_finite``'s reason for tensors whose float64 norm is ``norm``, read only when that norm
    is not finite: a norm taken in float64 (``code_norms``) is finite exactly when every value is, as
    no sum of squares of finite float32 values reaches float64's range."""
    return None if math.isfinite(norm) else check_finite(tensors)


def _all_finite(x: npt.NDArray[np.floating]) -> bool:
    flat = x.reshape(-1)
    flags = np.empty(min(_FINITE_CHUNK, flat.size), dtype=bool)
    for start in range(0, flat.size, _FINITE_CHUNK):
        chunk = flat[start : start + _FINITE_CHUNK]
        if not np.isfinite(chunk, out=flags[: chunk.size]).all():
            return False
    return True


def _normalised(weights: Sequence[float], count: int) -> list[float]:
    if count == 0:
        raise ValueError("nothing to merge: no contributions")
    if len(weights) != count:
        raise ValueError(f"{count} contributions but {len(weights)} weights")
    if any(not np.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"weights must be finite and >= 0, got {list(weights)}")
    top = float(max(weights))
    if top <= 0:
        raise ValueError("the weights sum to zero")
    scaled = [float(w) / top for w in weights]  # each in [0, 1]: the sum is at most the count
    total = sum(scaled)
    return [w / total for w in scaled]


def _same_shape(first: tuple[int, ...] | None, shape: tuple[int, ...]) -> tuple[int, ...]:
    if first is not None and shape != first:
        raise ValueError(f"contributions have different shapes: {sorted({first, shape})}")
    return shape


def _flat32(v: npt.NDArray[np.floating]) -> F32:
    """A contiguous float32 1-D view of ``v`` (a copy only when ``v`` is not float32 and contiguous)."""
    return np.ascontiguousarray(v, dtype=np.float32).reshape(-1)


def _norm(flat: F32) -> float:
    """The Euclidean norm of a contiguous float32 vector (one BLAS dot product)."""
    return math.sqrt(float(np.dot(flat, flat)))


def _length(v: F32 | Codes) -> float:
    """A contribution's norm: from its codes' float64 sum of squares when it is read from them
    (``code_norms``), else a float32 dot product (``_norm``); the two differ by the dot product's
    rounding."""
    return math.sqrt(v.sum_squares()) if isinstance(v, Codes) else _norm(v)


_ADD_BLOCK = 1 << 15  # values scaled at a time before their addition: the scaled block stays in the cache


class _Sum:
    """``sum scale_m * flat_m`` in float32, added in the order given. Each product is rounded to
    float32 and then added, block by block through a scratch block that stays in the cache (the
    values of whole-array operations, without a scratch array the size of the sum)."""

    def __init__(self) -> None:
        self.shape: tuple[int, ...] | None = None
        self._acc: F32 | None = None
        self._scratch: F32 | None = None

    def flat(self, v: Vector) -> F32 | Codes:
        """``v`` as ``add`` takes it (its shape checked against the others'): a float32 vector, or
        the codes it is read from."""
        self.shape = _same_shape(self.shape, tuple(v.shape))
        return v if isinstance(v, Codes) else _flat32(v)

    def add(self, flat: F32 | Codes, scale: float) -> None:
        """Add ``scale * flat`` (a vector from ``flat``)."""
        size = math.prod(flat.shape)
        if self._acc is not None and self._acc.size != size:
            raise ValueError(f"contributions have different sizes: {sorted({self._acc.size, size})}")
        if self._acc is None or self._scratch is None:
            self._acc = np.zeros(size, dtype=np.float32)
            self._scratch = np.empty(min(_ADD_BLOCK, size), dtype=np.float32)
        if scale == 0.0:
            return
        factor = np.float32(scale)
        if isinstance(flat, Codes):
            flat.add_to(self._acc, factor)
            return
        for start in range(0, flat.size, _ADD_BLOCK):
            part, acc = flat[start : start + _ADD_BLOCK], self._acc[start : start + _ADD_BLOCK]
            product = self._scratch[: part.size]
            np.multiply(part, factor, out=product)
            np.add(acc, product, out=acc)

    def total(self) -> F32:
        if self._acc is None or self.shape is None:
            raise ValueError("nothing to merge: no contributions")
        return self._acc.reshape(self.shape)


def scaled(x: npt.NDArray[np.float32], scale: float) -> npt.NDArray[np.float32]:
    """``x`` times ``scale`` in float32; in float64 for a scale below ``TINY_SCALE`` (a norm near
    float32's largest values brought to a small limit), which float32 would round to nothing."""
    if scale >= TINY_SCALE:
        return np.multiply(x, np.float32(scale), dtype=np.float32)
    return (x.astype(np.float64) * scale).astype(np.float32)


def weighted_mean(vectors: Collection[Vector], weights: Sequence[float]) -> F32:
    """``sum w_m v_m / sum w_m`` in float32, as ``sum (w_m / sum w) v_m``: no weight larger than 1
    multiplies a value, so large weights cannot overflow float32. Each vector is read once, in
    order, and let go once the next is read."""
    ws = _normalised(weights, len(vectors))
    if len(vectors) == 1:
        only = next(iter(vectors))
        return only.values() if isinstance(only, Codes) else np.array(only, dtype=np.float32)
    total = _Sum()
    for v, w in zip(vectors, ws, strict=True):
        total.add(total.flat(v), w)
    return total.total()


def rda(vectors: Collection[Vector], weights: Sequence[float]) -> F32:
    """Radial-directional average: mean norm x direction of the mean of unit directions.

    Falls back to the weighted mean when the mean direction vanishes (opposite contributions).
    Each contribution's norm is from its float64 sum of squares (``_length``), the mean
    direction's a float32 dot product; directions are summed in float32. Each vector is read once, in order (the norm and the direction from one reading), and
    read again only for the fallback.
    """
    ws = _normalised(weights, len(vectors))
    radius = 0.0
    direction = _Sum()
    for v, w in zip(vectors, ws, strict=True):
        flat = direction.flat(v)
        n = _length(flat)
        radius += w * n
        direction.add(flat, w / n if n > 0 else 0.0)
    merged = direction.total()
    dnorm = _norm(merged.reshape(-1))
    if dnorm < _MIN_DIRECTION_NORM:
        return weighted_mean(vectors, weights)
    merged *= np.float32(radius / dnorm)
    return merged


def _read(d: Mapping[str, npt.NDArray[np.floating]], name: str) -> Vector:
    """Tensor ``name`` of ``d``: from its codes where ``d`` offers them, else as an array."""
    codes = d.codes(name) if isinstance(d, FromCodes) else None
    return codes if codes is not None else d[name]


class _Column(Collection[Vector]):
    """Tensor ``name`` of each contribution, read from its mapping only as it is iterated (a lazily
    decoded payload decodes it then, or gives its codes), so a merge holds one contribution's
    tensor at a time."""

    def __init__(self, deltas: Sequence[Mapping[str, npt.NDArray[np.floating]]], name: str) -> None:
        self._deltas, self._name = deltas, name

    def __iter__(self) -> Iterator[Vector]:
        return (_read(d, self._name) for d in self._deltas)

    def __len__(self) -> int:
        return len(self._deltas)

    def __contains__(self, item: object) -> bool:
        return any(v is item for v in self)


def merge_fragment(
    deltas: Sequence[Mapping[str, npt.NDArray[np.floating]]],
    weights: Sequence[float],
    *,
    rule: MergeRule,
    kind: str,
    mean_tensors: Collection[str] = (),
) -> dict[str, F32]:
    """Merge each tensor of the fragment; the tensors of an embedding fragment, and ``mean_tensors``
    (embeddings sharing a fragment with dense tensors), always with the weighted mean."""
    _normalised(weights, len(deltas))
    if rule not in ("rda", "mean"):
        raise ValueError(f"unknown merge rule {rule!r} (expected 'rda' or 'mean')")
    names = set(deltas[0])
    for i, d in enumerate(deltas[1:], start=1):
        if set(d) != names:
            raise ValueError(f"contribution {i} has tensors {sorted(d)}, contribution 0 has {sorted(names)}")

    def combine(name: str) -> F32:
        mean = rule == "mean" or kind == "embedding" or name in mean_tensors
        return (weighted_mean if mean else rda)(_Column(deltas, name), weights)

    return {name: combine(name) for name in sorted(names)}
