"""One round of one fragment as a pure function: contribution weights → merge → outer step.

``merge_round`` takes the fragment's current parameters and outer-optimizer state, the
contributions the round policy (:mod:`diloco_core.rounds`) chose, in merge order, and the job's
settings, and returns the new parameters, the new optimizer state and what the round did. It edits
nothing it is given, so a round that fails, or whose result is never committed, leaves the
fragment exactly as it was. The synchronizer, the benchmark harness and the reduction-to-DiLoCo
test all run this function, so they run the same algorithm:

1. weights: ``tokens² / steps`` (or 1 without token weighting) times ``(1 + staleness)^-power`` per
   contribution (:func:`diloco_core.merge.contribution_weight`); all 1 when they sum to zero;
2. merge: RDA per tensor, or the weighted mean (always for an embedding fragment)
   (:func:`diloco_core.merge.merge_fragment`);
3. outer step: Nesterov or Delayed Nesterov on the merged Δ, counting every contribution
   (:class:`diloco_core.outer.OuterOptimizer`);
4. publication: with compressed downloads (``settings.down_codec``), the new version is the previous
   one plus the quantized difference, and the rest waits in the state's residual
   (:func:`diloco_core.downlink.publish`); otherwise the new version is the outer step's result.

Checks of the inputs before step 1 and of the merged update between steps 2 and 3 belong here too:
the result carries the update so that such a check can read it, and a merged update whose norm is
above ``max_update_norm`` is scaled down to it before the outer step (``RoundResult.update_scale``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import numpy.typing as npt

from diloco_core import downlink
from diloco_core.code_norms import arrays_norm
from diloco_core.config import DiLoCoSettings
from diloco_core.fragments import Fragment
from diloco_core.merge import contribution_weight, merge_fragment, scaled
from diloco_core.outer import OuterOptimizer, OuterState
from diloco_core.rounds import staleness

F32 = npt.NDArray[np.float32]


class MergeInput(Protocol):
    """What a round needs of one contribution: its outer gradient and the metadata that weighs it."""

    @property
    def base_version(self) -> int: ...

    @property
    def steps(self) -> int: ...

    @property
    def tokens(self) -> int: ...

    @property
    def tensors(self) -> Mapping[str, npt.NDArray[np.floating]]: ...


@dataclass(frozen=True)
class RoundResult:
    """A new version of the fragment and what produced it (per contribution, in the order given)."""

    version: int
    params: dict[str, F32]
    outer: OuterState
    update: dict[str, F32]  # the merged outer gradient Δ the outer step took
    weights: tuple[float, ...]
    staleness: tuple[int, ...]  # versions each contribution's base is behind the round's version
    down_blob: bytes | None = None  # with compressed downloads: the update from the previous version
    update_norm: float = math.nan  # of ``update`` as the outer step took it (inf when not finite)
    update_scale: float = 1.0  # what the merged update was multiplied by to bring it to ``max_update_norm``


def outer_optimizer(settings: DiLoCoSettings) -> OuterOptimizer:
    return OuterOptimizer(
        lr=settings.outer_lr,
        momentum=settings.outer_momentum,
        nesterov=True,
        delayed_every=settings.delayed_nesterov,
        warmup=settings.outer_warmup,
    )


def round_weights(contributions: Sequence[MergeInput], version: int, settings: DiLoCoSettings) -> list[float]:
    """The merge weight of each contribution to a round on ``version``; all 1.0 when they sum to zero
    (every contribution trained on zero tokens), so such a round is a plain average."""
    weights = [
        contribution_weight(
            c.tokens,
            c.steps,
            token_weighting=settings.token_weighting,
            staleness=staleness(c.base_version, version),
            staleness_power=settings.staleness_power,
        )
        for c in contributions
    ]
    if sum(weights) <= 0:
        return [1.0] * len(contributions)
    return weights


def merged_update(
    fragment: Fragment, version: int, contributions: Sequence[MergeInput], settings: DiLoCoSettings
) -> dict[str, F32]:
    """Steps 1 and 2: the contributions' merged Δ at their weights, each tensor read once."""
    return merge_fragment(
        [c.tensors for c in contributions],
        round_weights(contributions, version, settings),
        rule=settings.merge_rule,
        kind=fragment.kind,
        mean_tensors=fragment.mean_tensors,
    )


def merge_round(
    fragment: Fragment,
    params: Mapping[str, npt.NDArray[np.floating]],
    outer: OuterState,
    version: int,
    contributions: Sequence[MergeInput],
    settings: DiLoCoSettings,
    *,
    down_block_size: int = downlink.codec.q.DEFAULT_BLOCK_SIZE,
    max_update_norm: float = math.inf,
    merged: dict[str, F32] | None = None,
) -> RoundResult:
    """Version ``version + 1`` of ``fragment`` from version ``version`` (``params``, ``outer``) and
    the contributions merged into it; raises ``ValueError`` on inputs that cannot be merged
    (none, mismatched tensors or shapes). ``down_block_size``: the block of a blocked download codec;
    ``max_update_norm``: the merged update is scaled down to this norm when its own is above (a
    merged update with a value that is not finite is left as it is, for the caller's checks);
    ``merged``: ``merged_update`` of these same contributions, when the caller already made it (the
    contributions are then not read again); the round takes it over: a scaled-down update replaces
    its tensors in it, one at a time, so the unscaled ones are not held beside the outer step."""
    weights = round_weights(contributions, version, settings)
    update = merged if merged is not None else merged_update(fragment, version, contributions, settings)
    update_norm, update_scale = arrays_norm(update), 1.0
    if math.isfinite(update_norm) and update_norm > max_update_norm:
        update_scale = max_update_norm / update_norm
        for name in update:
            update[name] = scaled(update[name], update_scale)
        update_norm = arrays_norm(update)
    new_params, new_outer = outer_optimizer(settings).step(outer, params, update, count=len(contributions))
    down_blob = None
    if settings.down_codec == "fp32":
        new_outer = replace(new_outer, residual={})
    else:
        published = downlink.publish(
            params,
            new_params,
            outer.residual or None,
            fragment=fragment.index,
            version=version,
            quantizer=settings.down_codec,
            block_size=down_block_size,
            owned=True,  # the outer step's result: the published version replaces it
        )
        new_params, down_blob = published.params, published.blob
        new_outer = replace(new_outer, residual=published.residual)
    return RoundResult(
        version=version + 1,
        params=new_params,
        outer=new_outer,
        update=update,
        weights=tuple(weights),
        staleness=tuple(staleness(c.base_version, version) for c in contributions),
        down_blob=down_blob,
        update_norm=update_norm,
        update_scale=update_scale,
    )
