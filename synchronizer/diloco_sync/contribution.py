"""An accepted contribution waiting for its fragment's next round: its record, how a continuation
folds into it, and how far each learner's progress is merged.

Exactly once, in order: a contribution covers the steps ``since < step <= through`` of its learner's
progress on its base version. The fragment remembers, per learner, the newest base its merged
progress is on and the step that progress reaches (``merged_through``, kept in the manifest; an
excluded contribution's progress is not in it). A learner's progress on a base is taken in order: a
part must start where the record of that progress ends (the merged step, or the end of the learner's
pending part on that base), so a part never jumps over one the synchronizer does not hold
(``progress_conflict`` names the refusal: ``out_of_order`` with the step to start from,
``already_merged`` for progress merged, or on a base older than the newest merged one,
``overlaps_pending``). One on the same base as the learner's pending one is added to it (``fold``:
its parts), and one that covers it from the record's end supersedes it; the sum of the parts is held
to the same bounds as one contribution (``fold_problem``). Contributions read back from storage at
start-up may have a gap before them (a part only buffered in memory was lost with the process).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
from diloco_core import rounds as policy
from diloco_core.bounds import MAX_STEPS, MAX_TOKENS, MAX_TOKENS_PER_STEP
from diloco_core.layout import PendingMeta, contribution_key
from diloco_core.quantized_arrays import QuantizedArrays, TensorCodes

Arrays = dict[str, npt.NDArray[np.float32]]
Gradient = Mapping[str, npt.NDArray[np.float32]]
"""An outer gradient as a pending contribution holds it: read tensor by tensor (a payload's
``codec.QuantizedArrays``, or the ``Sum`` of the parts folded into one)."""


class Sum(Mapping[str, npt.NDArray[np.float32]]):
    """Two outer gradients added tensor by tensor when a tensor is read, so a folded contribution
    holds its parts as they came, not a float32 copy of their sum."""

    def __init__(self, first: Gradient, second: Gradient) -> None:
        self.first, self.second = first, second
        self.nbytes = held_bytes(first) + held_bytes(second)  # what the parts hold

    def __getitem__(self, name: str) -> npt.NDArray[np.float32]:
        """``first[name] + second[name]``, each side read the same way, with a stack instead of
        recursion: a learner may fold thousands of parts. A part kept as codes (a payload's
        ``QuantizedArrays`` in a blocked low-bit format) is added into the sum so far a few blocks
        at a time (``TensorCodes.add_to`` with a factor of 1, exact), without a float32 array of its
        own: the same float32 sums as ``left + right``."""
        todo: list[tuple[Gradient, _Step]] = [(self, "start")]
        done: list[tuple[npt.NDArray[np.float32], bool]] = []  # values, and whether this read made them
        while todo:
            node, step = todo.pop()
            if not isinstance(node, Sum):
                done.append(_read_part(node, name))
            elif step == "start":
                todo += [(node, "left read"), (node.first, "start")]
            elif step == "left read" and (codes := _codes(node.second, name, done[-1][0])) is not None:
                left, ours = done.pop()
                total = left if ours else np.array(left, dtype=np.float32)
                codes.add_to(total.reshape(-1), _ONE)
                done.append((total, True))
            elif step == "left read":
                todo += [(node, "both read"), (node.second, "start")]
            else:
                (right, _), (left, ours) = done.pop(), done.pop()
                if ours:
                    left += right  # the same float32 sums as left + right
                done.append((left if ours else left + right, True))
        return done[0][0]

    def __contains__(self, name: object) -> bool:
        return name in self.second

    def __iter__(self) -> Iterator[str]:
        return iter(self.second)

    def __len__(self) -> int:
        return len(self.second)


_Step = Literal["start", "left read", "both read"]
_ONE = np.float32(1)


def _read_part(part: Gradient, name: str) -> tuple[npt.NDArray[np.float32], bool]:
    """Tensor ``name`` of a part, and whether the array is a new one made by this read (a payload's
    tensors are decoded afresh at every read) rather than one the part holds."""
    return part[name], isinstance(part, QuantizedArrays)


def _codes(part: Gradient, name: str, onto: npt.NDArray[np.float32]) -> TensorCodes | None:
    """Tensor ``name`` of a part as codes to add onto the float32 array ``onto`` of its shape, where
    the part keeps it so (None otherwise: it is then read as an array and added)."""
    if not isinstance(part, QuantizedArrays) or onto.dtype != np.float32 or part.shape(name) != onto.shape:
        return None
    return part.codes(name)


def held_bytes(g: Gradient) -> int:
    """The bytes an outer gradient holds: a payload's decompressed data, a ``Sum``'s parts, arrays'."""
    held = getattr(g, "nbytes", None)
    return held if isinstance(held, int) else sum(np.asarray(a).nbytes for a in g.values())


COMPACT_AT = 2  # a Sum holding more than this many times its sum in float32 is added up


def needs_compacting(g: Gradient, dense_bytes: int) -> bool:
    """Whether a learner's folded progress holds more than ``COMPACT_AT`` times the ``dense_bytes``
    of its sum in float32 (many parts, each kept as it came): it is then added up once."""
    return isinstance(g, Sum) and g.nbytes > COMPACT_AT * dense_bytes


def compacted(g: Gradient) -> Arrays:
    """The sum of a folded outer gradient as float32 arrays: the parts added in the order a round
    reads them, so the same values bit for bit. ``ValueError`` when a part cannot be read."""
    return {name: g[name] for name in g}


@dataclass
class Contribution:
    """An accepted outer gradient waiting for its fragment's next round."""

    learner_id: str
    fragment: int
    base_version: int
    seq: int
    steps: int
    tokens: int
    tensors: Gradient
    nbytes: int
    received_at: float
    storage_key: str | None = None  # None while only in memory (storage was down)
    blob: bytes | None = None  # kept only while not yet written to storage
    since: int = 0  # the learner's progress on the base before this contribution (in steps)
    through: int = -1  # how far it reaches (-1: since + steps)
    # earlier contributions added into this one, each as received (their records: once the sum is
    # added up, their own tensors are dropped)
    parts: tuple[Contribution, ...] = ()
    norm: float | None = None  # of ``tensors``, when measured on arrival (None: read them for it)

    def __post_init__(self) -> None:
        if self.through < 0:
            self.through = self.since + self.steps

    @classmethod
    def from_meta(
        cls,
        meta: PendingMeta,
        tensors: Gradient,
        nbytes: int,
        storage_key: str | None = None,
        *,
        norm: float | None = None,
    ) -> Contribution:
        """A contribution from the record stored beside its payload (``PendingMeta``: the fields they share)."""
        return cls(**meta.model_dump(), tensors=tensors, nbytes=nbytes, storage_key=storage_key, norm=norm)

    def meta(self) -> PendingMeta:
        """The record stored beside its payload (``persistence.put_pending``)."""
        return PendingMeta(**{name: getattr(self, name) for name in PendingMeta.model_fields})

    @property
    def key(self) -> str:
        return contribution_key(self.learner_id, self.fragment, self.base_version, self.seq)

    def received(self) -> tuple[Contribution, ...]:
        """The contributions as received (their own keys, blobs and stored copies): the parts, then this one."""
        return (*self.parts, self)


def let_go(contributions: Iterable[Contribution]) -> None:
    """Drop the outer gradients of these contributions and of their parts (merged: never read again)."""
    for part in (part for c in contributions for part in c.received()):
        part.tensors = {}


def fold(earlier: Contribution, later: Contribution) -> Contribution:
    """One contribution of a learner's progress on a base from two that follow each other: the sum of
    the outer gradients, steps and tokens; ``later``'s own key, blob and stored copy stay its own."""
    return Contribution(
        learner_id=later.learner_id,
        fragment=later.fragment,
        base_version=later.base_version,
        seq=later.seq,
        steps=earlier.steps + later.steps,
        tokens=earlier.tokens + later.tokens,
        tensors=Sum(earlier.tensors, later.tensors),
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


def relation(
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


def progress_conflict(
    previous: Contribution | None,
    *,
    learner_id: str,
    fragment: int,
    base_version: int,
    since: int,
    through: int,
    newest_merged: int,
    start: int,
    current: int,
    in_order: bool,
) -> tuple[str, str] | None:
    """Why a contribution of ``learner_id`` holding the steps ``since < step <= through`` of its
    progress on ``base_version`` cannot be taken, as (code, reason); None when it can.
    ``previous``: the learner's pending contribution; ``newest_merged``: the newest base its merged
    progress is on; ``start``: where its progress on ``base_version`` not yet merged starts;
    ``current``: the fragment's version. ``in_order``: it must also start where the record of the
    learner's progress ends (off for contributions read back from storage, which may wait for a gap)."""
    where = f"learner {learner_id}'s progress on version {base_version} of fragment {fragment}"
    if base_version < newest_merged:
        return "already_merged", (
            f"learner {learner_id}'s progress on version {newest_merged} of fragment {fragment} is merged, "
            f"so none on the older version {base_version} is taken: take version {current}"
        )
    if since < start:
        return "already_merged", (
            f"{where} through step {start} is merged already (this contribution starts after step {since}): "
            f"send only the progress after step {start}, or take version {current}"
        )
    if previous is None or previous.base_version != base_version:
        expected = start
    else:
        where_now = relation(previous, since, through)
        if where_now == "overlaps":
            return "overlaps_pending", (
                f"learner {learner_id}'s pending contribution on version {base_version} of fragment "
                f"{fragment} holds steps {previous.since + 1} to {previous.through}; this one holds "
                f"steps {since + 1} to {through}"
            )
        fits = {
            "after": since == previous.through,
            "before": since == start and through == previous.since,
            "covers": since == start,
        }[where_now]
        expected = since if fits else (previous.through if where_now == "after" else start)
    if in_order and since != expected:
        return "out_of_order", (
            f"{where} is held through step {expected}; this contribution starts after step {since}: send "
            f"the progress after step {expected} first"
        )
    return None


def waiting_overlap(
    waiting: Iterable[Contribution], base_version: int, since: int, through: int
) -> tuple[int, str, str] | None:
    """Why a contribution holding the steps ``since < step <= through`` on ``base_version`` cannot be
    taken beside a learner's parts that wait behind a gap (409 ``overlaps_pending``: it shares steps
    with one of them), or None."""
    for w in waiting:
        if w.base_version == base_version and since < w.through and through > w.since:
            return (
                409,
                "overlaps_pending",
                (
                    f"learner {w.learner_id}'s contribution on version {base_version} of fragment {w.fragment} "
                    f"waiting for the progress before it holds steps {w.since + 1} to {w.through}; this one "
                    f"holds steps {since + 1} to {through}"
                ),
            )
    return None


def progress_refusal(
    previous: Contribution | None,
    *,
    waiting: Iterable[Contribution] = (),
    learner_id: str,
    fragment: int,
    base_version: int,
    since: int,
    steps: int,
    tokens: int,
    newest_merged: int,
    start: int,
    current: int,
    in_order: bool,
) -> tuple[int, str, str] | None:
    """Why a contribution cannot be taken, as (HTTP status, code, reason), or None when it can: a
    :func:`waiting_overlap` with the parts ``waiting`` behind a gap or a :func:`progress_conflict`
    (409), or a sum with the pending part it continues that is beyond the bounds of one
    contribution (400, :func:`fold_problem`)."""
    through = since + steps
    overlap = waiting_overlap(waiting, base_version, since, through)
    if overlap is not None:
        return overlap
    conflict = progress_conflict(
        previous,
        learner_id=learner_id,
        fragment=fragment,
        base_version=base_version,
        since=since,
        through=through,
        newest_merged=newest_merged,
        start=start,
        current=current,
        in_order=in_order,
    )
    if conflict is not None:
        return 409, *conflict
    if previous is None or previous.base_version != base_version:
        return None
    if relation(previous, since, through) not in ("after", "before"):
        return None
    problem = fold_problem(previous, steps, tokens)
    return (400, "bad_request", problem) if problem is not None else None
