"""Merging outer gradients of one fragment from several learners (docs/algorithm.md §3.6, §3.7).

Weights are token-weighted (``tokens * tokens / steps``: quantity x quality) with an optional
staleness discount. Tokens and steps are bounded (``diloco_core.bounds``), so a weight is a finite
float64, and the merge uses the weights divided by the largest of them (each in [0, 1]), so neither
their sum nor a weighted value can overflow whatever finite weights it is given. Non-embedding tensors are merged with Radial-Directional Averaging (norms and
directions averaged separately, so the merged norm does not shrink as ``1/sqrt(M)`` with M nearly
orthogonal contributions); embedding fragments with the weighted mean. Sums are float32, in the
order the contributions are given.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from diloco_core.bounds import MAX_STEPS, MAX_TOKENS

F32 = npt.NDArray[np.float32]
MergeRule = Literal["rda", "mean"]
TINY_SCALE = 1e-30  # a scale below this is applied in float64 (float32 would lose it below its range)

# The mean direction counts as vanished below this norm (unit directions averaged; 1 is the maximum).
_MIN_DIRECTION_NORM = 1e-6


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


def check_finite(tensors: Mapping[str, npt.NDArray[np.floating]]) -> str | None:
    """The reason to reject a contribution with NaN or infinite values, or None when all are finite."""
    for name in sorted(tensors):
        if not np.isfinite(tensors[name]).all():
            return f"non-finite values in {name!r}"
    return None


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


def _check_shapes(vectors: Sequence[npt.NDArray[np.floating]]) -> None:
    shapes = {v.shape for v in vectors}
    if len(shapes) > 1:
        raise ValueError(f"contributions have different shapes: {sorted(shapes)}")


def _flat32(v: npt.NDArray[np.floating]) -> F32:
    """A contiguous float32 1-D view of ``v`` (a copy only when ``v`` is not float32 and contiguous)."""
    return np.ascontiguousarray(v, dtype=np.float32).reshape(-1)


def _norm(flat: F32) -> float:
    """The Euclidean norm of a contiguous float32 vector (one BLAS dot product)."""
    return math.sqrt(float(np.dot(flat, flat)))


def _accumulate(flats: Sequence[F32], scales: Sequence[float]) -> F32:
    """``sum scale_m * flat_m`` in float32, in the order given, with one scratch buffer."""
    acc = np.zeros(flats[0].shape, dtype=np.float32)
    scratch = np.empty_like(acc)
    for flat, scale in zip(flats, scales, strict=True):
        if scale != 0.0:
            np.multiply(flat, np.float32(scale), out=scratch)
            acc += scratch
    return acc


def scaled(x: npt.NDArray[np.float32], scale: float) -> npt.NDArray[np.float32]:
    """``x`` times ``scale`` in float32; in float64 for a scale below ``TINY_SCALE`` (a norm near
    float32's largest values brought to a small limit), which float32 would round to nothing."""
    if scale >= TINY_SCALE:
        return np.multiply(x, np.float32(scale), dtype=np.float32)
    return (x.astype(np.float64) * scale).astype(np.float32)


def weighted_mean(vectors: Sequence[npt.NDArray[np.floating]], weights: Sequence[float]) -> F32:
    """``sum w_m v_m / sum w_m`` in float32, as ``sum (w_m / sum w) v_m``: no weight larger than 1
    multiplies a value, so large weights cannot overflow float32."""
    ws = _normalised(weights, len(vectors))
    _check_shapes(vectors)
    if len(vectors) == 1:
        return np.asarray(vectors[0], dtype=np.float32).copy()
    acc = _accumulate([_flat32(v) for v in vectors], ws)
    return acc.reshape(vectors[0].shape)


def rda(vectors: Sequence[npt.NDArray[np.floating]], weights: Sequence[float]) -> F32:
    """Radial-directional average: mean norm x direction of the mean of unit directions.

    Falls back to the weighted mean when the mean direction vanishes (opposite contributions).
    Norms are float32 dot products accumulated into a Python float; directions are summed in float32.
    """
    ws = _normalised(weights, len(vectors))
    _check_shapes(vectors)
    flats = [_flat32(v) for v in vectors]
    norms = [_norm(f) for f in flats]
    radius = sum(w * n for w, n in zip(ws, norms, strict=True))
    direction = _accumulate(flats, [w / n if n > 0 else 0.0 for w, n in zip(ws, norms, strict=True)])
    dnorm = _norm(direction)
    if dnorm < _MIN_DIRECTION_NORM:
        return weighted_mean(vectors, weights)
    direction *= np.float32(radius / dnorm)
    return direction.reshape(vectors[0].shape)


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
        return (weighted_mean if mean else rda)([d[name] for d in deltas], weights)

    return {name: combine(name) for name in sorted(names)}
