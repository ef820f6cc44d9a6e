"""What a round refuses to merge, decided before anything is committed (pure).

A learner with a valid token can send any finite outer gradient. Before a round commits, its inputs
and its result are checked:

- every contribution: finite, a merge weight that can be computed from its claims (steps and
  tokens within the bounds), and its norm within ``factor`` times the median norm of the
  fragment's recently merged contributions;
- the merged update Δ: finite, and its norm within ``factor`` times the median of the recent
  rounds' updates; the new parameters: finite.

Until the fragment has ``MIN_HISTORY`` rounds, both norms are held to ``factor`` times the norm of
the fragment's parameters instead (an outer gradient that moves them by many times their own size
is no training progress); with parameters all zero there is no bound yet.

A contribution that fails is excluded with a reason, and the round merges the others; when the
result fails, the contribution with the largest norm is excluded and the round is merged again
without it (a round never fails on input it accepted: at worst it merges nothing). The norm
checks start once ``MIN_HISTORY`` rounds of the fragment were merged, and ``factor`` 0 turns them
off (finiteness is always checked).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

from diloco_core.config import DiLoCoSettings
from diloco_core.fragments import Fragment
from diloco_core.merge import check_finite
from diloco_core.outer import OuterState
from diloco_core.round_math import MergeInput, RoundResult, merge_round, round_weights

HISTORY = 16  # norms remembered per fragment
MIN_HISTORY = 3  # rounds merged before the norm checks apply

M = TypeVar("M", bound=MergeInput)


def tensors_norm(tensors: Mapping[str, npt.NDArray[np.floating]]) -> float:
    """The Euclidean norm of all tensors together, in float64 (inf when a value is not finite)."""
    total = 0.0
    for name in sorted(tensors):
        flat = np.asarray(tensors[name], dtype=np.float64).ravel()
        total += float(np.dot(flat, flat))
    return math.sqrt(total) if math.isfinite(total) else math.inf


@dataclass(frozen=True)
class NormHistory:
    """Norms of a fragment's recently merged contributions and updates, oldest first."""

    contributions: tuple[float, ...] = ()
    updates: tuple[float, ...] = ()

    def after(self, contributions: Sequence[float], update: float) -> NormHistory:
        """The history once a round merged contributions of these norms into an update of this norm."""
        return NormHistory(
            (*self.contributions, *contributions)[-HISTORY:], (*self.updates, update)[-HISTORY:]
        )

    def limit(self, which: Sequence[float], factor: float, params_norm: float = 0.0) -> float:
        """The largest norm allowed given these recent norms, or while there are too few of them, the
        parameters' norm (inf with neither, or with factor 0)."""
        if factor <= 0:
            return math.inf
        if len(self.updates) >= MIN_HISTORY and which:
            return factor * median(which)
        return factor * params_norm if params_norm > 0 else math.inf


@dataclass(frozen=True)
class Screened(Generic[M]):
    """A round after its checks: the result (None when nothing could be merged), the contributions
    merged (in the order given) and those excluded, each with its reason."""

    result: RoundResult | None
    merged: tuple[M, ...]
    excluded: tuple[tuple[M, str], ...]
    norms: tuple[float, ...] = field(default=())  # of the merged contributions, in order


def _result_problem(
    result: RoundResult, history: NormHistory, factor: float, params_norm: float
) -> str | None:
    reason = check_finite(result.update)
    if reason is not None:
        return f"merged update: {reason}"
    reason = check_finite(result.params)
    if reason is not None:
        return f"new parameters: {reason}"
    norm, limit = tensors_norm(result.update), history.limit(history.updates, factor, params_norm)
    if norm > limit:
        return f"merged update norm {norm:.4g} is above the limit {limit:.4g} (max_update_norm_factor {factor:g})"
    return None


def _weight_problem(c: MergeInput, version: int, settings: DiLoCoSettings) -> str | None:
    """Why a contribution's merge weight cannot be computed (its claims are beyond the bounds), so
    that exactly it is excluded rather than the round failing on it."""
    try:
        round_weights([c], version, settings)
    except ValueError as exc:
        return f"its weight cannot be computed: {exc}"
    return None


def screened_round(
    fragment: Fragment,
    params: Mapping[str, npt.NDArray[np.floating]],
    outer: OuterState,
    version: int,
    contributions: Sequence[M],
    settings: DiLoCoSettings,
    history: NormHistory,
) -> Screened[M]:
    """``round_math.merge_round`` of the contributions that pass the checks, with a result that passes
    them (see the module's docstring); never raises on a contribution's values."""
    factor = settings.max_update_norm_factor
    params_norm = tensors_norm(params)
    limit = history.limit(history.contributions, factor, params_norm)
    kept: list[tuple[M, float]] = []
    excluded: list[tuple[M, str]] = []
    for c in contributions:
        reason = check_finite(c.tensors) or _weight_problem(c, version, settings)
        norm = tensors_norm(c.tensors)
        if reason is None and norm > limit:
            reason = f"norm {norm:.4g} is above the limit {limit:.4g} (max_update_norm_factor {factor:g})"
        if reason is None:
            kept.append((c, norm))
        else:
            excluded.append((c, reason))
    while kept:
        try:
            with np.errstate(over="ignore", invalid="ignore"):  # an overflow is found by the checks below
                result = merge_round(fragment, params, outer, version, [c for c, _ in kept], settings)
        except (ArithmeticError, ValueError) as exc:
            problem: str | None = f"the round could not be merged: {exc}"
        else:
            problem = _result_problem(result, history, factor, params_norm)
            if problem is None:
                return Screened(result, tuple(c for c, _ in kept), tuple(excluded), tuple(n for _, n in kept))
        largest = max(range(len(kept)), key=lambda i: kept[i][1])
        excluded.append((kept.pop(largest)[0], f"{problem}; excluded as the largest contribution"))
    return Screened(None, (), tuple(excluded))
