"""What a round merges, and how much of each, decided before anything is committed (pure).

A learner with a valid token can send any finite outer gradient. Before a round commits, its inputs
and its result are checked:

- every contribution: finite, and a merge weight that can be computed from its claims (steps and
  tokens within the bounds), else it is excluded with a reason;
- its norm: within ``factor`` times the lower median of the norms of the fragment's recently merged
  contributions and of this round's, each norm taken per square root of its steps up to H
  (``step_scale``), and the limit scaled back by the contribution's own steps. A contribution above
  its limit is **clipped**: merged scaled down to the limit, with the reason;
- the merged update Δ: finite, and its norm within ``factor`` times the lower median of the recent
  rounds' updates, else scaled down to it before the outer step; the new parameters: finite.

Clipped, not excluded: what one learner can do to a round is bounded either way, but an excluded
honest contribution is lost. In a job of two learners the lower median is the smaller learner's, and
an honest learner that lags (a loaded machine, a late start) sends parts of a step or two, small
early in its learning-rate warm-up; excluded above that limit, the other learner's whole
contributions were left out of every round. Clipped, they are merged at up to ``factor`` times the
usual step, and the limit follows once the lagging learner's steps grow.

The lower median: a learner whose norms are half of those counted cannot raise the limit, so the
limit does not ratchet up round after round (the history keeps the norms as merged, clipped ones at
their limit). While fewer than ``MIN_HISTORY`` norms are known, both norms are held to ``factor``
times the reference norm instead: the fragment's parameters' norm at its first checked round, kept
with the history in the committed state (an outer gradient that moves them by many times their own
size is no training progress, and a fixed reference does not compound over the first rounds); with
parameters all zero there is no bound yet.

When the result is not finite (sums that overflow), the contribution with the largest norm is
excluded and the round is merged again without it (a round never fails on input it accepted: at
worst it merges nothing). ``factor`` 0 turns the norm bounds off (finiteness is always checked).

A contribution that carries no norm from arrival and is not read from its codes (a learner's parts
folded into one, added up only when read) is read once: the merged update of every contribution
whose weight can be computed, taken whole, is made first (``round_math.merged_update``), and each
such contribution's norm is measured as that merge reads it (``merge_inputs.MeasuredTensors``: each
tensor's sum of squares as ``tensors_norm`` takes it, so the same norm). When the checks then keep
every one of them whole, the round goes on from that update, bit for bit what merging after
measuring gives; otherwise (one clipped or excluded, or a merge that raised) the update is dropped
and the round merged as above, with the norms measured: such a round reads every contribution
twice. It is not made when the norms known without reading values already say the round cannot
take every contribution whole (one excluded, or one above its limit whatever the unknown norms
are). The outer step and the download are made once either way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from diloco_core import downlink
from diloco_core.code_norms import arrays_norm, norm_of_sums
from diloco_core.config import DiLoCoSettings
from diloco_core.fragments import Fragment
from diloco_core.merge import check_finite, non_finite_reason
from diloco_core.merge_inputs import Measured, MeasuredTensors, as_merged, unmeasured
from diloco_core.outer import OuterState
from diloco_core.quantized_arrays import QuantizedArrays
from diloco_core.round_math import F32, MergeInput, RoundResult, merge_round, merged_update, round_weights

HISTORY = 16  # norms remembered per fragment
MIN_HISTORY = 3  # norms known before the checks compare with them
FLOOR = 1e-3  # of the reference norm: the lower median counts as at least this much

M = TypeVar("M", bound=MergeInput)


def tensors_norm(tensors: Mapping[str, npt.NDArray[np.floating]]) -> float:
    """The Euclidean norm of all tensors together, in float64 (inf when a value is not finite); each
    tensor is read once, a payload's quantized tensors from their codes where the format allows
    (``QuantizedArrays.sum_squares``)."""
    if not isinstance(tensors, QuantizedArrays):
        return arrays_norm(tensors)
    return norm_of_sums(tensors.sum_squares(name) for name in sorted(tensors))


def contribution_norm(c: MergeInput) -> float:
    """The norm of a contribution's outer gradient: the one it carries (``norm``, measured when it
    was checked on arrival), else ``tensors_norm`` of its tensors."""
    known = getattr(c, "norm", None)
    return known if isinstance(known, float) else tensors_norm(c.tensors)


def step_scale(steps: int, inner_steps: int) -> float:
    """What a contribution's norm is divided by before it is compared with others': the square root
    of its steps, at most H (a partial contribution of a few steps and a whole one of H compare
    alike; claiming more than H steps buys no larger limit)."""
    return math.sqrt(min(max(steps, 1), max(inner_steps, 1)))


def lower_median(values: Sequence[float]) -> float:
    """The lower of the two middle values (the middle one for an odd count): with half of the
    values its own, one learner cannot raise it."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


@dataclass(frozen=True)
class NormHistory:
    """Norms of a fragment's recently merged contributions (per ``step_scale``) and updates, oldest
    first, and the norm
    of its parameters when the first round was checked (``reference``). Kept in the fragment's
    committed state, so a restart does not reopen the window in which there is no history yet."""

    contributions: tuple[float, ...] = ()
    updates: tuple[float, ...] = ()
    reference: float = 0.0

    def after(self, contributions: Sequence[float], update: float) -> NormHistory:
        """The history once a round merged contributions of these norms into an update of this norm."""
        return NormHistory(
            (*self.contributions, *contributions)[-HISTORY:],
            (*self.updates, update)[-HISTORY:],
            self.reference,
        )

    def with_reference(self, params_norm: float) -> NormHistory:
        """This history with a reference norm: the one it has, or ``params_norm`` for a first round."""
        return self if self.reference > 0 else replace(self, reference=params_norm)

    def limit(self, norms: Sequence[float], factor: float) -> float:
        """The largest norm allowed: ``factor`` times the lower median of ``norms`` once there are
        ``MIN_HISTORY`` of them, else ``factor`` times the reference norm (inf with neither, or with
        factor 0). A fixed reference, not the current parameters' norm: limits that followed the
        parameters would compound over the first rounds. The lower median counts as at least
        ``FLOOR`` times the reference: norms of zero (a learner that sends nothing, or tensors
        that do not train) cannot bring the limit to zero and freeze the fragment."""
        if factor <= 0:
            return math.inf
        if len(norms) >= MIN_HISTORY:
            return factor * max(lower_median(norms), FLOOR * self.reference)
        return factor * self.reference if self.reference > 0 else math.inf


class Checked(NamedTuple):
    """How many contributions rounds' checks excluded, and how many they merged clipped."""

    excluded: int = 0
    clipped: int = 0

    def plus(self, other: Checked) -> Checked:
        return Checked(self.excluded + other.excluded, self.clipped + other.clipped)


@dataclass(frozen=True)
class Screened(Generic[M]):
    """A round after its checks: the result (None when nothing could be merged), the contributions
    merged (in the order given), those of them merged scaled down to their limit and those excluded,
    each with its reason."""

    result: RoundResult | None
    merged: tuple[M, ...]
    excluded: tuple[tuple[M, str], ...]
    norms: tuple[float, ...] = field(default=())  # of the merged contributions as merged, per step_scale
    history: NormHistory = field(default_factory=lambda: NormHistory())  # the one checked against
    clipped: tuple[tuple[M, str], ...] = ()
    update_clipped: str | None = None  # why the merged update was scaled down, when it was

    @property
    def update_norm(self) -> float:
        """The norm of the result's update as the outer step took it (NaN without a result)."""
        return self.result.update_norm if self.result is not None else math.nan

    def next_history(self) -> NormHistory:
        """The fragment's norm history once this round is committed."""
        return self.history.after(self.norms, self.update_norm)


def _result_problem(result: RoundResult) -> str | None:
    """Why the result of a round cannot be committed, or None (the update read only when its norm,
    from ``code_norms.arrays_norm``, is not finite)."""
    reason = non_finite_reason(result.update, result.update_norm)
    if reason is not None:
        return f"merged update: {reason}"
    reason = check_finite(result.params)
    if reason is not None:
        return f"new parameters: {reason}"
    return None


def _above(norm: float, limit: float, what: str, factor: float) -> str:
    return f"norm {norm:.4g} is above the limit {limit:.4g}{what} (max_update_norm_factor {factor:g})"


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
    *,
    down_block_size: int = downlink.codec.q.DEFAULT_BLOCK_SIZE,
) -> Screened[M]:
    """``round_math.merge_round`` of the contributions that pass the checks, each at most at its
    limit, with a result that passes them (see the module's docstring); never raises on a
    contribution's values. ``down_block_size``: the block of a blocked download codec."""
    factor = settings.max_update_norm_factor
    history = history.with_reference(tensors_norm(params))
    update_limit = history.limit(history.updates, factor)

    def merge(inputs: Sequence[MergeInput], merged: dict[str, F32] | None) -> RoundResult | str:
        return _merged(
            fragment, params, outer, version, inputs, settings, down_block_size, update_limit, merged
        )

    weight_problems = [_weight_problem(c, version, settings) for c in contributions]
    weighable = {i: c for i, c in enumerate(contributions) if weight_problems[i] is None}
    # norms known without reading values: carried from arrival, or from a payload's codes
    known = {i: _checked_norm(c, None) for i, c in enumerate(contributions) if not unmeasured(c)}
    first: dict[str, F32] | None = None
    measured: dict[int, float] = {}
    if not _not_whole_for_sure(history, settings, weighable, known):
        first, measured = _update_measuring(fragment, version, settings, weighable)
    checked: list[tuple[M, float]] = []
    excluded: list[tuple[M, str]] = []
    for i, c in enumerate(contributions):
        norm, reason = known[i] if i in known else _checked_norm(c, measured.get(i))
        reason = reason or weight_problems[i]
        if reason is None:
            checked.append((c, norm))
        else:
            excluded.append((c, reason))
    limits, _ = _limits(history, settings, checked)
    kept = [(c, n, limit) for (c, n), limit in zip(checked, limits, strict=True)]
    # the update merged as the norms were measured is the round's when every contribution it took
    # is kept whole
    whole = len(kept) == len(weighable) and all(norm <= limit for _, norm, limit in kept)
    merged, first = (first if whole else None), None  # one merged update held at a time
    while kept:
        outcome = merge([as_merged(c, norm, limit) for c, norm, limit in kept], merged)
        if not isinstance(outcome, str):
            return _screened(outcome, kept, excluded, history, settings)
        problem, merged = outcome, None
        largest = max(range(len(kept)), key=lambda i: kept[i][1])
        excluded.append((kept.pop(largest)[0], f"{problem}; excluded as the largest contribution"))
    return Screened(None, (), tuple(excluded))


def _checked_norm(c: MergeInput, measured: float | None) -> tuple[float, str | None]:
    """A contribution's norm (``measured`` when its merge measured it; inf exactly when a value is
    not finite) and why it cannot be merged, if it cannot."""
    try:
        norm = contribution_norm(c) if measured is None else measured
        return norm, None if math.isfinite(norm) else check_finite(c.tensors) or f"its norm is {norm}"
    except ValueError as exc:  # a tensor read from its payload only now, and malformed
        return math.inf, f"its outer gradient cannot be read: {exc}"


def _limits(
    history: NormHistory,
    settings: DiLoCoSettings,
    checked: Sequence[tuple[MergeInput, float]],
    unknown: int = 0,
) -> tuple[list[float], bool]:
    """Each checked contribution's norm limit, and whether the limits are relative (the history's
    and the round's norms per ``step_scale`` number ``MIN_HISTORY``: the round's own norms count
    beside the history's, so that among two one cannot set the limit). ``unknown``: norms not known
    yet, each taken as inf, which can only raise the lower median: the limits are then bounds from
    above on the round's, once they are relative without them."""
    scales = [step_scale(c.steps, settings.inner_steps) for c, _ in checked]
    pool = [*history.contributions, *(n / scale for (_, n), scale in zip(checked, scales, strict=True))]
    relative = len(pool) >= MIN_HISTORY
    base_limit = history.limit([*pool, *[math.inf] * unknown], settings.max_update_norm_factor)
    return [base_limit * (scale if relative else 1.0) for scale in scales], relative


def _not_whole_for_sure(
    history: NormHistory,
    settings: DiLoCoSettings,
    weighable: Mapping[int, MergeInput],
    known: Mapping[int, tuple[float, str | None]],
) -> bool:
    """Whether the round cannot take every weighable contribution whole, whatever the norms not
    known yet: one of known norm is excluded, or above its limit with each unknown norm taken as
    inf, once the norms known already make the limit relative (``_limits``). The update merged
    while measuring would then be dropped: it is not made."""
    ours = [(c, known[i]) for i, c in weighable.items() if i in known]
    if any(reason is not None for _, (_, reason) in ours):
        return True
    norms = [(c, n) for c, (n, _) in ours]
    limits, relative = _limits(history, settings, norms, unknown=len(weighable) - len(ours))
    return relative and any(n > limit for (_, n), limit in zip(norms, limits, strict=True))


def _merged(
    fragment: Fragment,
    params: Mapping[str, npt.NDArray[np.floating]],
    outer: OuterState,
    version: int,
    inputs: Sequence[MergeInput],
    settings: DiLoCoSettings,
    down_block_size: int,
    update_limit: float,
    merged: dict[str, F32] | None,
) -> RoundResult | str:
    """``merge_round`` of these inputs (``merged``: their merged update when already made), or why
    its result cannot be committed."""
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is found by the checks
            result = merge_round(
                fragment,
                params,
                outer,
                version,
                inputs,
                settings,
                down_block_size=down_block_size,
                max_update_norm=update_limit,
                merged=merged,
            )
    except (ArithmeticError, ValueError) as exc:
        return f"the round could not be merged: {exc}"
    return _result_problem(result) or result


def _update_measuring(
    fragment: Fragment, version: int, settings: DiLoCoSettings, inputs: Mapping[int, MergeInput]
) -> tuple[dict[str, F32] | None, dict[int, float]]:
    """When some of ``inputs`` carry no norm (``merge_inputs.unmeasured``): their merged update, all
    taken whole in order (``round_math.merged_update``), and those norms, measured as it read them,
    by the inputs' keys. ``(None, {})`` when none is unmeasured, or when the merge raised (the round
    then measures and merges as it would have)."""
    measuring = {i: MeasuredTensors(c.tensors) for i, c in inputs.items() if unmeasured(c)}
    if not measuring:
        return None, {}
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            update = merged_update(
                fragment,
                version,
                [Measured(c, measuring[i]) if i in measuring else c for i, c in inputs.items()],
                settings,
            )
    except (ArithmeticError, ValueError):
        return None, {}
    norms = {i: tensors.norm() for i, tensors in measuring.items()}
    return update, {i: norm for i, norm in norms.items() if norm is not None}


def _screened(
    result: RoundResult,
    kept: Sequence[tuple[M, float, float]],
    excluded: Sequence[tuple[M, str]],
    history: NormHistory,
    settings: DiLoCoSettings,
) -> Screened[M]:
    """What a round that passed its checks merged (each contribution with its norm and limit),
    clipped and excluded."""
    factor = settings.max_update_norm_factor
    clipped = tuple(
        (c, _above(norm, limit, f" for {c.steps} steps", factor) + "; merged at the limit")
        for c, norm, limit in kept
        if norm > limit
    )
    update_clipped = None
    if result.update_scale < 1.0:
        norm = result.update_norm
        update_clipped = _above(norm / result.update_scale, norm, "", factor) + "; taken at the limit"
    return Screened(
        result,
        tuple(c for c, _, _ in kept),
        tuple(excluded),
        tuple(min(n, limit) / step_scale(c.steps, settings.inner_steps) for c, n, limit in kept),
        history,
        clipped,
        update_clipped,
    )
