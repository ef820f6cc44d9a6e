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

Exactly once, in order: a contribution covers the steps ``since < step <= through`` of its learner's
progress on its base version. The fragment remembers, per learner, the newest base its merged
progress is on and the step that progress reaches (``merged_through``, kept in the manifest; an
excluded contribution's progress is not in it). A learner's progress on a base is taken in order:
a part must start where the record of that progress ends (``progress_start``: the merged step, or
the end of the learner's pending part on that base), so a part never jumps over one the
synchronizer does not hold (``conflict`` names the refusal: ``out_of_order`` with the step to start
from, ``already_merged`` for progress merged, or on a base older than the newest merged one,
``overlaps_pending``). One on the same base as the learner's pending one is added to it (its parts),
and one that covers it from the record's end supersedes it; the sum of the parts is held to the
same bounds as one contribution (``fold_problem``; ``refusal`` makes both checks). Contributions read back from storage at
start-up may have a gap before them (a part only buffered in memory was lost with the process):
they wait, outside the round, until the learner resends the missing part (``ready``), and are
dropped once their base is stale (``drop_stale_gaps``).

Mutated only on the event loop; merges run in a worker thread on values handed over to them, and
hand back new values (the parameters and outer state are never edited in place).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Collection, Iterable
from typing import Literal

from diloco_core import downlink
from diloco_core import rounds as policy
from diloco_core.fragments import Fragment
from diloco_core.outer import OuterState
from diloco_core.screening import NormHistory

from .contribution import Arrays, Contribution, _relation, fold, fold_problem, merged_through, round_entry
from .pace import kept_times

KEPT_UPDATES = 16  # compressed downloads: the updates kept, so a reader that many versions behind walks them
News = Literal["version", "round"] | None
Phase = Literal["uninitialised", "initialising", "open", "merging", "committed"]
_APPLIED_KEYS = 4096  # idempotency keys of merged (or superseded) contributions remembered


class TransitionError(RuntimeError):
    """A transition asked for in a phase that does not allow it (a defect of the caller)."""


class FragmentState:
    """One fragment's state; read it through the properties, change it only through the transitions."""

    def __init__(self, spec: Fragment) -> None:
        self.spec = spec
        self._outer = OuterState()
        self._version = -1
        self._params: Arrays | None = None
        self._payload: bytes | None = None  # the current version, encoded once for every reader
        self._initial_digest: str | None = None  # of version 0's values, while it is current
        # with compressed downloads: the recent versions' updates (version -> update from the one before)
        self._updates: dict[int, bytes] = {}
        self._rounds = 0
        self._phase: Phase = "uninitialised"
        self._round = policy.open_round(spec.index, -1, 0.0)
        self._pending: dict[str, Contribution] = {}  # by learner
        self._applied: deque[str] = deque(maxlen=_APPLIED_KEYS)
        self._reserved: set[str] = set()  # keys being validated/persisted right now
        self._merging: tuple[Contribution, ...] = ()  # the round being merged and committed
        self._merged_through: dict[str, tuple[int, int]] = {}  # learner -> (base version, step) merged
        self._version_times: dict[int, float] = {}  # version -> when it was committed (wall clock)
        self._norms = NormHistory()  # of the recent rounds, as committed
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

    @property
    def initial_digest(self) -> str | None:
        """While the fragment is at version 0: the digest of its values (a learner that built the same
        initial parameters holds it already); None at any other version."""
        return self._initial_digest

    def payload_for(self, have: int, newer_than: int) -> tuple[int, bytes] | None:
        """What to send a reader holding version ``have`` exactly that asks for a version newer than
        ``newer_than``, as (version, payload); None while there is no version. With compressed
        downloads (``diloco_core.downlink``): the update from ``have`` when the current version is the
        next one; when it is several versions behind, the first link of the chain of updates from it
        (the version after ``have``: the reader asks again for the next) while the whole chain is
        held and smaller than the whole version; else the whole current version."""
        if self._version < 0 or self._payload is None:
            return None
        current = (self._version, self._payload)
        if have < 0 or have < newer_than or have >= self._version:
            return current
        chain: list[bytes] = []
        for v in range(have + 1, self._version + 1):
            link = self._updates.get(v)
            if link is None:
                return current
            chain.append(link)
        if len(chain) > 1 and sum(map(len, chain)) >= len(self._payload):
            return current
        return have + 1, chain[0]

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
    def version_times(self) -> dict[int, float]:
        """When the recent versions were committed (wall clock; ``pace``)."""
        return dict(self._version_times)

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

    def progress_start(self, learner_id: str, base_version: int) -> int:
        """The step where ``learner_id``'s progress on ``base_version`` not yet merged (nor being
        merged) starts: how far its merged progress on that base reaches, 0 on a newer base."""
        base, merged = merged_through(self._merged_through, self._merging).get(learner_id, (-1, 0))
        return merged if base == base_version else 0

    def ready(self, c: Contribution) -> bool:
        """True when nothing of the learner's progress before ``c`` is missing (it may be merged)."""
        return c.since == self.progress_start(c.learner_id, c.base_version)

    def conflict(
        self, learner_id: str, base_version: int, since: int, through: int, *, in_order: bool = True
    ) -> tuple[str, str] | None:
        """Why a contribution of ``learner_id`` on ``base_version`` holding the steps after ``since``
        through ``through`` cannot be taken, as (code, reason), or None when it can. ``in_order``
        (every live request): it must also start where the record of the learner's progress ends;
        off for contributions read back from storage at start-up, which may wait for a gap."""
        newest, _ = merged_through(self._merged_through, self._merging).get(learner_id, (-1, 0))
        if base_version < newest:
            return "already_merged", (
                f"learner {learner_id}'s progress on version {newest} of fragment {self.index} is merged, "
                f"so none on the older version {base_version} is taken: take version {self.version}"
            )
        start = self.progress_start(learner_id, base_version)
        if since < start:
            return "already_merged", (
                f"learner {learner_id}'s progress on version {base_version} of fragment {self.index} "
                f"through step {start} is merged already (this contribution starts after step {since}): "
                f"send only the progress after step {start}, or take version {self.version}"
            )
        previous = self._pending.get(learner_id)
        if previous is None or previous.base_version != base_version:
            expected = start
        else:
            relation = _relation(previous, since, through)
            if relation == "overlaps":
                return "overlaps_pending", (
                    f"learner {learner_id}'s pending contribution on version {base_version} of fragment "
                    f"{self.index} holds steps {previous.since + 1} to {previous.through}; this one holds "
                    f"steps {since + 1} to {through}"
                )
            fits = {
                "after": since == previous.through,
                "before": since == start and through == previous.since,
                "covers": since == start,
            }[relation]
            expected = since if fits else (previous.through if relation == "after" else start)
        if in_order and since != expected:
            return "out_of_order", (
                f"learner {learner_id}'s progress on version {base_version} of fragment {self.index} is "
                f"held through step {expected}; this contribution starts after step {since}: send the "
                f"progress after step {expected} first"
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

    def finish_init(self, params: Arrays, payload: bytes, now: float, quorum: int, *, digest: str) -> None:
        """Version 0 is durable; ``digest``: its ``downlink.digest`` (computed off the event loop)."""
        self._expect("initialising")
        self._phase = "open"
        self._version_times = kept_times({}, 0, now)
        self._publish(0, params, payload, initial_digest=digest)
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
        norms: NormHistory | None = None,
        version_times: dict[int, float] | None = None,
    ) -> None:
        """Start from the committed state read back from storage."""
        self._expect("uninitialised")
        self._outer, self._rounds, self._phase = outer, rounds, "open"
        self._norms = norms if norms is not None else NormHistory()
        self._applied.extend(applied)
        self._merged_through = dict(merged_through or {})
        self._version_times = dict(version_times or {})
        # at start-up, before anything is served: version 0's digest, if the job is still there
        self._publish(
            version, params, payload, initial_digest=downlink.digest(params) if version == 0 else None
        )
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

    def refusal(
        self,
        learner_id: str,
        base_version: int,
        since: int,
        steps: int,
        tokens: int,
        *,
        in_order: bool = True,
    ) -> tuple[int, str, str] | None:
        """Why a contribution cannot be taken, as (HTTP status, code, reason), or None when it can:
        a :meth:`conflict` (409), or a sum with the pending part it continues that is beyond the
        bounds of one contribution (400, :func:`fold_problem`)."""
        through = since + steps
        conflict = self.conflict(learner_id, base_version, since, through, in_order=in_order)
        if conflict is not None:
            return 409, *conflict
        previous = self._pending.get(learner_id)
        if previous is None or previous.base_version != base_version:
            return None
        if _relation(previous, since, through) not in ("after", "before"):
            return None
        problem = fold_problem(previous, steps, tokens)
        return (400, "bad_request", problem) if problem is not None else None

    def accept(self, c: Contribution, quorum: int) -> Contribution | None:
        """Queue a contribution for the next round. The learner's pending one is continued by it
        (same base, ``c.since`` at its ``through``, or ``c`` filling the gap before it: the two are
        added up) or superseded by it; returns the one superseded, whose keys are remembered as
        applied so that a resend of it is a duplicate. The caller checked :meth:`conflict` and
        :func:`fold_problem` first. A contribution with a gap before it waits outside the round."""
        self._expect("open", "merging", "committed")
        previous = self._pending.get(c.learner_id)
        if previous is not None and previous.base_version == c.base_version:
            relation = _relation(previous, c.since, c.through)
            if relation == "after":
                c, previous = fold(previous, c), None
            elif relation == "before":
                c, previous = fold(c, previous), None
        opens = not any(self.ready(x) for x in self._pending.values() if x.learner_id != c.learner_id)
        self._pending[c.learner_id] = c
        if self.ready(c):
            if opens:  # a round opens when its first contribution arrives (the fragment fell due)
                self._round = policy.open_round(self.index, self._version, c.received_at)
            self._round = policy.add_contribution(self._round, round_entry(c), quorum=quorum)
        if previous is not None:
            self._applied.extend(part.key for part in previous.received())
        if opens:
            self._notify()  # learners waiting with announce_rounds hear of it at once
        return previous

    def drop_stale_gaps(self, max_staleness: int) -> list[Contribution]:
        """Drop the pending contributions still waiting for a missing earlier part whose base is
        now too old to be merged; returns them (their keys are not applied: a resend is judged anew)."""
        stale = [
            name
            for name, c in self._pending.items()
            if not self.ready(c) and policy.is_stale(c.base_version, self._version, max_staleness)
        ]
        return [self._pending.pop(name) for name in stale]

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
        self,
        *,
        version: int,
        params: Arrays,
        payload: bytes,
        outer: OuterState,
        now: float,
        quorum: int,
        norms: NormHistory | None = None,
        excluded: int = 0,
        update: bytes | None = None,
        merged: Collection[str] | None = None,
    ) -> None:
        """The merged version is durable: make it current, wake every long-poll waiting for it, and
        start the next round with whatever is still pending. Every contribution of the merge (those
        its checks excluded too) is done with: its keys are applied. Only the progress of those
        merged (``merged``: their keys; None: all) is recorded as merged. ``update``: the version as
        the update from the previous one (compressed downloads)."""
        self._expect("merging")
        self._norms = norms if norms is not None else self._norms
        self._excluded += excluded
        self._applied.extend(part.key for c in self._merging for part in c.received())
        taken = [c for c in self._merging if merged is None or c.key in merged]
        self._merged_through = merged_through(self._merged_through, taken)
        self._version_times = kept_times(self._version_times, version, now)
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
        ready = sorted((c for c in self._pending.values() if self.ready(c)), key=lambda c: c.received_at)
        self._round = policy.open_round(self.index, self._version, ready[0].received_at if ready else now)
        for c in ready:
            self._round = policy.add_contribution(self._round, round_entry(c), quorum=quorum)

    # -- news for long-polls ---------------------------------------------------------------------

    def round_open_for(self, learner_id: str, version: int) -> bool:
        """True when a round on ``version`` is collecting contributions and ``learner_id`` has none in it."""
        return (
            not self.busy
            and bool(self._round.pending)
            and self.version == version
            and self.round.version == version
            and learner_id not in self._pending
        )

    def _publish(
        self,
        version: int,
        params: Arrays,
        payload: bytes,
        update: bytes | None = None,
        initial_digest: str | None = None,
    ) -> None:
        """Make a new version current and wake every long-poll waiting for it (``initial_digest``: of
        version 0, which only the initial parameters are)."""
        self._version, self._params, self._payload = version, params, payload
        self._initial_digest = initial_digest
        if update is None:
            self._updates = {}  # a chain with a gap is no chain
        else:
            self._updates = {v: u for v, u in self._updates.items() if v > version - KEPT_UPDATES}
            self._updates[version] = update
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
