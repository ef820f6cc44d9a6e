"""In-memory state of one fragment as a small state machine: its global version and outer-optimizer
state, what waits to be merged, and who waits for news.

Phases, and the transitions between them (methods of :class:`FragmentState`; nothing else edits it)::

    uninitialised --begin_init--> initialising --finish_init--> open
                                  initialising --abort_init---> uninitialised
    uninitialised --restore--> open                       (start-up: the committed state)
    open --start_merge--> merging --commit--> committed --settle--> open
                          merging --abort---> open

``committed``: the new version is published, but the fragment's storage is still being tidied (its
old versions deleted), and the next merge must not write the fragment's objects meanwhile.

Contributions are taken in every phase from ``open`` on (during a merge they wait for the next
round): ``reserve`` an idempotency key while a contribution is checked and written, ``release`` it
after, ``accept`` the contribution into the next round, ``exclude`` the ones the round policy leaves
out, ``mark_durable`` one held in memory once it is written. A key is known (a resend is a
duplicate) while reserved, pending, merging, or applied.

Exactly once: a contribution covers the steps ``since < step <= through`` of its learner's progress
on its base version. One on the same base as the learner's pending one whose steps do not overlap
it (a continuation, or an earlier one resent after a restart) is added to it (its parts); one that
covers it (the whole progress from the base again) supersedes it. Progress already merged, or being merged, is never taken again
(``overlap`` names the conflict; the learner is refused): the fragment remembers, per learner, how
far its progress on a base was merged (``merged_through``, kept in the manifest).

Mutated only on the event loop; merges run in a worker thread on values handed over to them, and
hand back new values (the parameters and outer state are never edited in place).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
from diloco_core import rounds as policy
from diloco_core.fragments import Fragment
from diloco_core.outer import OuterState
from diloco_core.screening import NormHistory

Arrays = dict[str, npt.NDArray[np.float32]]
News = Literal["version", "round"] | None
Phase = Literal["uninitialised", "initialising", "open", "merging", "committed"]
_APPLIED_KEYS = 4096  # idempotency keys of merged (or superseded) contributions remembered


class TransitionError(RuntimeError):
    """A transition asked for in a phase that does not allow it (a defect of the caller)."""


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
        return f"{self.learner_id}/{self.fragment}/{self.base_version}/{self.seq}"

    def received(self) -> tuple[Contribution, ...]:
        """The contributions as received (their own keys, blobs and stored copies): the parts, then this one."""
        return (*self.parts, self)


def fold(earlier: Contribution, later: Contribution) -> Contribution:
    """One contribution of a learner's progress on a base from two that follow each other: the sum of
    the outer gradients, steps and tokens; ``later``'s own key, blob and stored copy stay its own."""
    tensors = {name: earlier.tensors[name] + later.tensors[name] for name in later.tensors}
    return Contribution(
        learner_id=later.learner_id, fragment=later.fragment, base_version=later.base_version, seq=later.seq,
        steps=earlier.steps + later.steps, tokens=earlier.tokens + later.tokens, tensors=tensors,
        nbytes=later.nbytes, received_at=earlier.received_at, storage_key=later.storage_key, blob=later.blob,
        since=earlier.since, through=later.through, parts=(*earlier.received(), *later.parts),
    )  # fmt: skip


def round_entry(c: Contribution) -> policy.Contribution:
    """What the round policy knows of a contribution."""
    return policy.Contribution(c.learner_id, c.base_version, c.steps, c.tokens, c.received_at)


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


class FragmentState:
    """One fragment's state; read it through the properties, change it only through the transitions."""

    def __init__(self, spec: Fragment) -> None:
        self.spec = spec
        self._outer = OuterState()
        self._version = -1
        self._params: Arrays | None = None
        self._payload: bytes | None = None  # the current version, encoded once for every reader
        self._update: bytes | None = None  # with compressed downloads: the current version's update
        self._rounds = 0
        self._phase: Phase = "uninitialised"
        self._round = policy.open_round(spec.index, -1, 0.0)
        self._pending: dict[str, Contribution] = {}  # by learner
        self._applied: deque[str] = deque(maxlen=_APPLIED_KEYS)
        self._reserved: set[str] = set()  # keys being validated/persisted right now
        self._merging: tuple[Contribution, ...] = ()  # the round being merged and committed
        self._merged_through: dict[str, tuple[int, int]] = {}  # learner -> (base version, step) merged
        self._norms = NormHistory()  # of the rounds merged since start-up
        self._excluded = 0  # contributions the rounds' checks left out since start-up
        self._changed = asyncio.Event()

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def version(self) -> int:
        """The current global version (-1: no parameters yet)."""
        return self._version

    @property
    def params(self) -> Arrays | None:
        return self._params

    def payload_for(self, have: int) -> bytes | None:
        """What takes a reader holding version ``have`` exactly to the current version: the update
        from the previous version (compressed downloads, ``diloco_core.downlink``) when ``have`` is
        that version and the update is known, the whole version otherwise (None: no version yet)."""
        if self._update is not None and have == self._version - 1:
            return self._update
        return self._payload

    @property
    def outer(self) -> OuterState:
        """The outer optimizer's state after the current version."""
        return self._outer

    @property
    def rounds(self) -> int:
        """Rounds merged into this fragment since the job began."""
        return self._rounds

    @property
    def round(self) -> policy.RoundState:
        """The round now collecting contributions, as the round policy sees it."""
        return self._round

    @property
    def pending(self) -> dict[str, Contribution]:
        """The contributions waiting for the next round, by learner (read only: see the transitions)."""
        return self._pending

    @property
    def applied(self) -> tuple[str, ...]:
        """Idempotency keys of contributions merged or superseded, oldest first."""
        return tuple(self._applied)

    @property
    def norms(self) -> NormHistory:
        """Norms of the recently merged contributions and updates (the rounds' checks compare with them)."""
        return self._norms

    @property
    def excluded(self) -> int:
        """Contributions the rounds' checks excluded since start-up."""
        return self._excluded

    @property
    def merged_through(self) -> dict[str, tuple[int, int]]:
        """Per learner, the base version of its newest merged contribution and the step its merged
        progress on that base reaches."""
        return dict(self._merged_through)

    @property
    def busy(self) -> bool:
        """True while an init or a merge holds the fragment (no other may start)."""
        return self.phase in ("initialising", "merging", "committed")

    def is_known(self, key: str) -> bool:
        """True when a contribution with this idempotency key was taken already."""
        return (
            key in self._reserved
            or any(part.key == key for c in self._merging for part in c.received())
            or key in self._applied
            or any(part.key == key for c in self._pending.values() for part in c.received())
        )

    def is_durable(self, key: str) -> bool:
        """True when the contribution with this key is merged or written to storage (False while it
        is only buffered in memory, being checked, or unknown)."""
        if key in self._applied:
            return True
        for c in (*self._merging, *self._pending.values()):
            for part in c.received():
                if part.key == key:
                    return part.storage_key is not None
        return False

    def overlap(self, learner_id: str, base_version: int, since: int, through: int) -> str | None:
        """Why a contribution of ``learner_id`` on ``base_version`` with the steps after ``since``
        through ``through`` would take progress a second time (None: it would not)."""
        base, merged = merged_through(self._merged_through, self._merging).get(learner_id, (-1, 0))
        merged = merged if base == base_version else 0
        if since < merged:
            return (
                f"learner {learner_id}'s progress on version {base_version} of fragment {self.index} "
                f"through step {merged} is merged already (this contribution starts after step {since}): "
                f"send only the progress after step {merged}, or take version {self.version}"
            )
        previous = self._pending.get(learner_id)
        if (
            previous is not None
            and previous.base_version == base_version
            and _relation(previous, since, through) == "overlaps"
        ):
            return (
                f"learner {learner_id}'s pending contribution on version {base_version} of fragment "
                f"{self.index} holds steps {previous.since + 1} to {previous.through}; this one holds "
                f"steps {since + 1} to {through}"
            )
        return None

    def _expect(self, *phases: Phase) -> None:
        if self.phase not in phases:
            raise TransitionError(f"fragment {self.index} is {self.phase}, not {' or '.join(phases)}")

    # -- initial parameters ----------------------------------------------------------------------

    def begin_init(self) -> None:
        """Hold the fragment while its initial parameters are written (no second init meanwhile)."""
        self._expect("uninitialised")
        self._phase = "initialising"

    def finish_init(self, params: Arrays, payload: bytes, now: float, quorum: int) -> None:
        self._expect("initialising")
        self._phase = "open"
        self._publish(0, params, payload)
        self._open_round(now, quorum)

    def abort_init(self) -> None:
        self._expect("initialising")
        self._phase = "uninitialised"

    def restore(
        self,
        *,
        version: int,
        params: Arrays,
        payload: bytes,
        outer: OuterState,
        applied: Iterable[str],
        rounds: int,
        now: float,
        quorum: int,
        merged_through: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        """Start from the committed state read back from storage."""
        self._expect("uninitialised")
        self._outer, self._rounds, self._phase = outer, rounds, "open"
        self._applied.extend(applied)
        self._merged_through = dict(merged_through or {})
        self._publish(version, params, payload)
        self._open_round(now, quorum)

    # -- contributions ---------------------------------------------------------------------------

    def reserve(self, key: str) -> bool:
        """Hold an idempotency key while its contribution is checked and written; False when the
        key is known already (a duplicate)."""
        if self.is_known(key):
            return False
        self._reserved.add(key)
        return True

    def release(self, key: str) -> None:
        """The contribution of a reserved key was accepted or refused."""
        self._reserved.discard(key)

    def accept(self, c: Contribution, quorum: int) -> Contribution | None:
        """Queue a contribution for the next round. The learner's pending one is continued by it
        (same base, ``c.since`` at or past its ``through``: the two are added up) or superseded by it;
        returns the one superseded, whose keys are remembered as applied so that a resend of it is
        a duplicate. The caller checked :meth:`overlap` first."""
        self._expect("open", "merging", "committed")
        previous = self._pending.get(c.learner_id)
        opens = not self._pending
        if opens:  # a round opens when its first contribution arrives (the fragment fell due)
            self._round = policy.open_round(self.index, self._version, c.received_at)
        if previous is not None and previous.base_version == c.base_version:
            relation = _relation(previous, c.since, c.through)
            if relation == "after":
                c, previous = fold(previous, c), None
            elif relation == "before":
                c, previous = fold(c, previous), None
        self._pending[c.learner_id] = c
        self._round = policy.add_contribution(self._round, round_entry(c), quorum=quorum)
        if previous is not None:
            self._applied.extend(part.key for part in previous.received())
        if opens:
            self._notify()  # learners waiting with announce_rounds hear of it at once
        return previous

    def exclude(self, learners: Collection[str], quorum: int) -> dict[str, Contribution]:
        """Drop the pending contributions of ``learners`` (left out by the round policy) and start the
        round again with the rest; returns the ones dropped, by learner."""
        dropped = {name: c for name in learners if (c := self._pending.pop(name, None)) is not None}
        if learners:
            self._open_round(self.round.opened_at, quorum)
        return dropped

    def mark_durable(self, c: Contribution, storage_key: str) -> bool:
        """A contribution held in memory was written under ``storage_key``; False when it is no
        longer pending (merged or superseded meanwhile): that copy is not needed."""
        pending = self._pending.get(c.learner_id)
        if pending is None or c.blob is None or all(part is not c for part in pending.received()):
            return False
        c.storage_key, c.blob = storage_key, None
        return True

    # -- rounds ----------------------------------------------------------------------------------

    def start_merge(self, learners: Iterable[str]) -> list[Contribution]:
        """Take the pending contributions of ``learners`` (in that order) into a merge."""
        self._expect("open")
        taken = [self._pending.pop(name) for name in learners]
        self._merging = tuple(taken)
        self._phase = "merging"
        return taken

    def commit(
        self, *, version: int, params: Arrays, payload: bytes, outer: OuterState, now: float, quorum: int,
        norms: NormHistory | None = None, excluded: int = 0, update: bytes | None = None,
    ) -> None:  # fmt: skip
        """The merged version is durable: make it current, wake every long-poll waiting for it, and
        start the next round with whatever is still pending. Every contribution of the merge (those
        its checks excluded too) is done with: its keys are applied. ``update``: the version as the
        update from the previous one (compressed downloads)."""
        self._expect("merging")
        self._norms = norms if norms is not None else self._norms
        self._excluded += excluded
        self._applied.extend(part.key for c in self._merging for part in c.received())
        self._merged_through.update(merged_through(self._merged_through, self._merging))
        self._outer, self._rounds, self._phase = outer, self.rounds + 1, "committed"
        self._publish(version, params, payload, update)
        self._open_round(now, quorum)

    def settle(self) -> None:
        """After a commit, the fragment's storage is tidy: the next merge may start."""
        self._expect("committed")
        self._merging, self._phase = (), "open"

    def reject(self) -> list[Contribution]:
        """The round's checks excluded every contribution of the merge: the fragment stays at its
        version, their keys are applied (a resend is a duplicate); returns them."""
        self._expect("merging")
        rejected, self._merging, self._phase = list(self._merging), (), "open"
        self._applied.extend(part.key for c in rejected for part in c.received())
        self._excluded += len(rejected)
        return rejected

    def abort(self) -> list[Contribution]:
        """The merge failed: the fragment stays at its version; returns the contributions it held."""
        self._expect("merging")
        given_back, self._merging, self._phase = list(self._merging), (), "open"
        return given_back

    def _open_round(self, now: float, quorum: int) -> None:
        """Start the round of the current version with whatever is still pending."""
        start = min((c.received_at for c in self._pending.values()), default=now)
        self._round = policy.open_round(self.index, self._version, start)
        for c in sorted(self._pending.values(), key=lambda c: c.received_at):
            self._round = policy.add_contribution(self._round, round_entry(c), quorum=quorum)

    # -- news for long-polls ---------------------------------------------------------------------

    def round_open_for(self, learner_id: str, version: int) -> bool:
        """True when a round on ``version`` is collecting contributions and ``learner_id`` has none in it."""
        return (
            not self.busy
            and bool(self._pending)
            and self.version == version
            and self.round.version == version
            and learner_id not in self._pending
        )

    def _publish(self, version: int, params: Arrays, payload: bytes, update: bytes | None = None) -> None:
        """Make a new version current and wake every long-poll waiting for it."""
        self._version, self._params, self._payload, self._update = version, params, payload, update
        self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_newer(self, newer_than: int, timeout: float, round_for: str | None = None) -> News:
        """Wait until the version exceeds ``newer_than`` ("version"), or, when ``round_for`` names a
        learner, until a round on ``newer_than`` is open that it has not joined ("round"); None on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            news = self._news(newer_than, round_for)
            remaining = deadline - loop.time()
            if news is not None or remaining <= 0:
                return news
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    def _news(self, newer_than: int, round_for: str | None) -> News:
        if self.version > newer_than:
            return "version"
        if round_for is not None and self.round_open_for(round_for, newer_than):
            return "round"
        return None
