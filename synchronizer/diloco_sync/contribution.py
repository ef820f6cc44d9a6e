"""An accepted contribution waiting for its fragment's next round: its record, how a continuation
folds into it, and how far each learner's progress is merged."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
from diloco_core import rounds as policy
from diloco_core.bounds import MAX_STEPS, MAX_TOKENS, MAX_TOKENS_PER_STEP
from diloco_core.layout import contribution_key

Arrays = dict[str, npt.NDArray[np.float32]]


@dataclass
class Contribution:
    """An accepted outer gradient waiting for its fragment's next round."""

    learner_id: str
    fragment: int
    base_version: int
    seq: int
    steps: int
    tokens: int
    tensors: Arrays
    nbytes: int
    received_at: float
    storage_key: str | None = None  # None while only in memory (storage was down)
    blob: bytes | None = None  # kept only while not yet written to storage
    since: int = 0  # the learner's progress on the base before this contribution (in steps)
    through: int = -1  # how far it reaches (-1: since + steps)
    parts: tuple[Contribution, ...] = ()  # earlier contributions added into this one, each as received

    def __post_init__(self) -> None:
        if self.through < 0:
            self.through = self.since + self.steps

    @property
    def key(self) -> str:
        return contribution_key(self.learner_id, self.fragment, self.base_version, self.seq)

    def received(self) -> tuple[Contribution, ...]:
        """The contributions as received (their own keys, blobs and stored copies): the parts, then this one."""
        return (*self.parts, self)


def fold(earlier: Contribution, later: Contribution) -> Contribution:
    """One contribution of a learner's progress on a base from two that follow each other: the sum of
    the outer gradients, steps and tokens; ``later``'s own key, blob and stored copy stay its own."""
    tensors = {name: earlier.tensors[name] + later.tensors[name] for name in later.tensors}
    return Contribution(
        learner_id=later.learner_id,
        fragment=later.fragment,
        base_version=later.base_version,
        seq=later.seq,
        steps=earlier.steps + later.steps,
        tokens=earlier.tokens + later.tokens,
        tensors=tensors,
        nbytes=later.nbytes,
        received_at=earlier.received_at,
        storage_key=later.storage_key,
        blob=later.blob,
        since=earlier.since,
        through=later.through,
        parts=(*earlier.received(), *later.parts),
    )


def fold_problem(pending: Contribution, steps: int, tokens: int) -> str | None:
    """Why adding ``steps`` and ``tokens`` to a learner's pending contribution would claim more than
    one contribution may (None: within the bounds every contribution is held to, ``diloco_core.bounds``)."""
    steps, tokens = pending.steps + steps, pending.tokens + tokens
    if steps > MAX_STEPS or tokens > MAX_TOKENS or tokens > steps * MAX_TOKENS_PER_STEP:
        return (
            f"with learner {pending.learner_id}'s pending progress on version {pending.base_version} of "
            f"fragment {pending.fragment} this would claim {tokens} tokens in {steps} steps, beyond the "
            f"bounds of one contribution (at most {MAX_STEPS:.0e} steps, {MAX_TOKENS:.0e} tokens, "
            f"{MAX_TOKENS_PER_STEP:.0e} tokens per step)"
        )
    return None


def round_entry(c: Contribution) -> policy.RoundEntry:
    """What the round policy knows of a contribution."""
    return policy.RoundEntry(c.learner_id, c.base_version, c.steps, c.tokens, c.received_at)


def _relation(
    pending: Contribution, since: int, through: int
) -> Literal["after", "before", "covers", "overlaps"]:
    """Where the steps ``since < step <= through`` lie against a pending contribution's."""
    if since >= pending.through:
        return "after"
    if through <= pending.since:
        return "before"
    if since <= pending.since and through >= pending.through:
        return "covers"
    return "overlaps"


def merged_through(
    known: dict[str, tuple[int, int]], merged: Iterable[Contribution]
) -> dict[str, tuple[int, int]]:
    """How far each learner's progress is merged once ``merged`` is: per learner, the newest base
    version and the furthest step on it."""
    out = dict(known)
    for c in merged:
        base, through = out.get(c.learner_id, (-1, 0))
        if c.base_version > base:
            out[c.learner_id] = (c.base_version, c.through)
        elif c.base_version == base:
            out[c.learner_id] = (base, max(through, c.through))
    return out
