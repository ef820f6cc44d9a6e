"""In-memory state of one fragment as a small state machine: its global version and outer-optimizer
state, what waits to be merged, and who waits for news.

Phases, and the transitions between them (methods of :class:`FragmentState`; nothing else edits it)::

    uninitialised --begin_init--> initialising --finish_init--> open
                                  initialising --abort_init---> uninitialised
    uninitialised --restore--> open                       (start-up: the committed state)
    open --start_merge--> merging --commit--> committed --settle--> open
                          merging --abort---> open

``committed``: the version is published; its old versions are being deleted (no merge meanwhile).
Contributions are taken in every phase from ``open`` on (``reserve``, ``refusal``, ``release``,
``accept``, ``exclude``, ``mark_durable``); a part with a gap before it waits until the learner
resends the missing one (``ready``, ``learner_parts``) or its base is stale (``drop_stale_gaps``).
Mutated only on the event loop; merges run in a worker thread on values handed to them.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Literal

from diloco_core import rounds as policy
from diloco_core.fragments import Fragment
from diloco_core.outer import OuterState
from diloco_core.screening import Checked, NormHistory

from .contribution import Arrays, Contribution, merged_through, progress_refusal, round_entry
from .held_state import HeldState
from .idempotency import IdempotencyKeys
from .learner_parts import LearnerParts
from .pace import kept_times
from .publication import News, Publication, Served

NOTHING_CHECKED = Checked()
Phase = Literal["uninitialised", "initialising", "open", "merging", "committed"]


class TransitionError(RuntimeError):
    """A transition asked for in a phase that does not allow it (a defect of the caller)."""


class FragmentState:
    """One fragment's state; read it through the properties, change it only through the transitions."""

    def __init__(self, spec: Fragment) -> None:
        self.spec = spec
        self._state = HeldState()
        self._served = Publication()
        self._rounds = 0
        self._phase: Phase = "uninitialised"
        self._round = policy.open_round(spec.index, -1, 0.0)
        self._parts = LearnerParts()  # the learners' parts outside the merge: pending, and waiting
        self._keys = IdempotencyKeys()
        self._merging: tuple[Contribution, ...] = ()  # the round being merged and committed
        self._merged_through: dict[str, tuple[int, int]] = {}  # learner -> (base version, step) merged
        self._version_times: dict[int, float] = {}  # version -> when it was committed (wall clock)
        self._norms = NormHistory()  # of the recent rounds, as committed
        self._checked = Checked()  # contributions the rounds' checks excluded and clipped since start-up

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def version(self) -> int:
        """The current global version (-1: no parameters yet)."""
        return self._served.version

    @property
    def served(self) -> Publication:
        """The current version as served: its payload, the recent updates, version 0's digest."""
        return self._served

    @property
    def state(self) -> HeldState:
        """The parameters and outer state after the current version, in memory or in storage (read only)."""
        return self._state

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
        return self._parts.pending

    @property
    def waiting(self) -> dict[str, tuple[Contribution, ...]]:
        """Per learner, the parts that wait behind a gap after its pending one, in step order (read only)."""
        return self._parts.waiting()

    @property
    def applied(self) -> tuple[str, ...]:
        """Idempotency keys of contributions merged or superseded, oldest first."""
        return self._keys.applied

    @property
    def norms(self) -> NormHistory:
        """Norms of the recently merged contributions and updates (the rounds' checks compare with them)."""
        return self._norms

    @property
    def checked(self) -> Checked:
        """Contributions the rounds' checks excluded, and merged clipped to their limit, since start-up."""
        return self._checked

    @property
    def merged_through(self) -> dict[str, tuple[int, int]]:
        """Per learner, the base of its newest merged contribution and how far its merged progress reaches."""
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
        return self._keys.is_known(key, self.held())

    def is_durable(self, key: str) -> bool:
        """True when the contribution with this key is merged or written to storage (not only buffered)."""
        return self._keys.is_durable(key, self.held())

    def held(self) -> tuple[Contribution, ...]:
        """The contributions the fragment holds: being merged, pending, then waiting behind a gap."""
        return (*self._merging, *self.queued())

    def queued(self) -> tuple[Contribution, ...]:
        """The parts outside the merge: pending, then waiting behind a gap."""
        return tuple(self._parts.all())

    def progress_start(self, learner_id: str, base_version: int) -> int:
        """Where ``learner_id``'s progress on ``base_version`` not merged (nor being merged) starts."""
        base, merged = merged_through(self._merged_through, self._merging).get(learner_id, (-1, 0))
        return merged if base == base_version else 0

    def ready(self, c: Contribution) -> bool:
        """True when nothing of the learner's progress before ``c`` is missing (it may be merged)."""
        return c.since == self.progress_start(c.learner_id, c.base_version)

    def _expect(self, *phases: Phase) -> None:
        if self.phase not in phases:
            raise TransitionError(f"fragment {self.index} is {self.phase}, not {' or '.join(phases)}")

    # -- initial parameters ----------------------------------------------------------------------

    def begin_init(self) -> None:
        """Hold the fragment while its initial parameters are written (no second init meanwhile)."""
        self._expect("uninitialised")
        self._phase = "initialising"

    def finish_init(
        self,
        params: Arrays,
        payload: Served,
        now: float,
        quorum: int,
        *,
        digest: str,
        outer_key: str | None = None,
    ) -> None:
        """Version 0 is durable (``digest``: its ``downlink.digest``; ``outer_key``: its outer state)."""
        self._expect("initialising")
        self._phase = "open"
        self._version_times = kept_times({}, 0, now)
        self._state.hold(params, self._state.outer, payload, outer_key)
        self._served.publish(0, payload, initial_digest=digest)
        self._open_round(now, quorum)

    def abort_init(self) -> None:
        self._expect("initialising")
        self._phase = "uninitialised"

    def restore(
        self,
        *,
        version: int,
        params: Arrays | None,
        payload: Served,
        outer: OuterState,
        applied: Iterable[str],
        rounds: int,
        now: float,
        quorum: int,
        merged_through: dict[str, tuple[int, int]] | None = None,
        norms: NormHistory | None = None,
        version_times: dict[int, float] | None = None,
        outer_key: str | None = None,
        initial_digest: str | None = None,
    ) -> None:
        """Start from the committed state read back from storage (``outer_key``: where its outer state
        is; ``params`` None for a version served from storage; ``initial_digest``: version 0's, for
        version 0 only)."""
        self._expect("uninitialised")
        self._rounds, self._phase = rounds, "open"
        self._state.hold(params, outer, payload, outer_key)
        self._norms = norms if norms is not None else NormHistory()
        self._keys.apply(applied)
        self._merged_through = dict(merged_through or {})
        self._version_times = dict(version_times or {})
        self._served.publish(version, payload, initial_digest=initial_digest)
        self._open_round(now, quorum)

    # -- contributions ---------------------------------------------------------------------------

    def reserve(self, key: str) -> bool:
        """Hold an idempotency key while its contribution is checked and written; False when the
        key is known already (a duplicate)."""
        return self._keys.reserve(key, self.held())

    def release(self, key: str) -> None:
        """The contribution of a reserved key was accepted or refused."""
        self._keys.release(key)

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
        """Why a contribution of ``learner_id`` (``steps`` after ``since`` on ``base_version``) cannot be
        taken, as (HTTP status, code, reason), or None (``contribution.progress_refusal``); ``in_order``:
        it starts where the learner's progress ends (off for those read back at start-up)."""
        newest, _ = merged_through(self._merged_through, self._merging).get(learner_id, (-1, 0))
        return progress_refusal(
            self._parts.pending.get(learner_id),
            waiting=self._parts.waiting_of(learner_id),
            learner_id=learner_id,
            fragment=self.index,
            base_version=base_version,
            since=since,
            steps=steps,
            tokens=tokens,
            newest_merged=newest,
            start=self.progress_start(learner_id, base_version),
            current=self.version,
            in_order=in_order,
        )

    def accept(self, c: Contribution, quorum: int) -> list[Contribution]:
        """Queue a contribution (``LearnerParts.place``; the caller checked :meth:`refusal`); returns the
        parts it superseded, whose keys are applied (a resend is a duplicate). The round holds exactly
        the pending parts that are ready."""
        self._expect("open", "merging", "committed")
        head, superseded = self._parts.place(c)
        if head is None:
            return []
        opens = not any(self.ready(x) for x in self._parts.pending.values() if x.learner_id != c.learner_id)
        if self.ready(head):
            if opens:  # a round opens when its first contribution arrives (the fragment fell due)
                self._round = policy.open_round(self.index, self.version, head.received_at)
            self._round = policy.add_contribution(self._round, round_entry(head), quorum=quorum)
        elif head.learner_id in self._round.pending:  # the part it replaced was in the round: it leaves
            self._open_round(self._round.opened_at, quorum)
        self._keys.apply_all(superseded)
        if opens:
            self._served.notify()  # learners waiting with announce_rounds hear of it at once
        return superseded

    def drop_stale_gaps(self, max_staleness: int) -> list[Contribution]:
        """Drop the parts with a gap before them whose base is too old to be merged; returns them
        (their keys are not applied: a resend is judged anew)."""
        return self._parts.drop(
            lambda c: policy.is_stale(c.base_version, self.version, max_staleness), self.ready
        )

    def exclude(self, learners: Collection[str], quorum: int) -> dict[str, Contribution]:
        """Drop the pending parts of ``learners`` (the round policy left them out); returns them."""
        dropped = {name: c for name in learners if (c := self._parts.take(name)) is not None}
        if learners:
            self._open_round(self.round.opened_at, quorum)
        return dropped

    def mark_durable(self, c: Contribution, storage_key: str) -> bool:
        """A part held in memory was written under ``storage_key``; False when it is held no more."""
        held = [self._parts.pending.get(c.learner_id), *self._parts.waiting_of(c.learner_id)]
        if c.blob is None or all(part is not c for x in held if x is not None for part in x.received()):
            return False
        c.storage_key, c.blob = storage_key, None
        return True

    # -- rounds ----------------------------------------------------------------------------------

    def start_merge(self, learners: Iterable[str]) -> list[Contribution]:
        """Take the pending contributions of ``learners`` (in that order) into a merge."""
        self._expect("open")
        taken = [self._parts.pending[name] for name in learners]
        for name in learners:
            self._parts.take(name)
        self._merging = tuple(taken)
        self._phase = "merging"
        return taken

    def commit(
        self,
        *,
        version: int,
        params: Arrays,
        payload: Served,
        outer: OuterState,
        now: float,
        quorum: int,
        norms: NormHistory | None = None,
        checked: Checked = NOTHING_CHECKED,
        update: bytes | None = None,
        merged: Collection[str] | None = None,
        outer_key: str | None = None,
    ) -> None:
        """The merged version is durable: make it current, wake every long-poll waiting for it, and
        start the next round with whatever is still pending. Every contribution of the merge (those
        its checks excluded too) is done with: its keys are applied. Only the progress of those
        merged (``merged``: their keys; None: all) is recorded as merged. ``update``: the version as
        the update from the previous one (compressed downloads); ``outer_key``: the outer state's object."""
        self._expect("merging")
        self._norms = norms if norms is not None else self._norms
        self._checked = self._checked.plus(checked)
        self._keys.apply_all(self._merging)
        taken = [c for c in self._merging if merged is None or c.key in merged]
        self._merged_through = merged_through(self._merged_through, taken)
        self._merging = tuple(taken)  # those the checks excluded no longer count as merged (``ready``)
        self._version_times = kept_times(self._version_times, version, now)
        self._rounds, self._phase = self.rounds + 1, "committed"
        self._state.hold(params, outer, payload, outer_key)
        self._served.publish(version, payload, update)
        self._open_round(now, quorum)

    def settle(self) -> None:
        """After a commit, the fragment's storage is tidy: the next merge may start."""
        self._expect("committed")
        self._merging, self._phase = (), "open"

    def reject(self, quorum: int) -> list[Contribution]:
        """The round's checks excluded every contribution of the merge: their keys are applied, and
        the round starts again with the parts still ready; returns them."""
        self._expect("merging")
        rejected, self._merging, self._phase = list(self._merging), (), "open"
        self._keys.apply_all(rejected)
        self._checked = self._checked.plus(Checked(excluded=len(rejected)))
        self._open_round(self._round.opened_at, quorum)
        return rejected

    def abort(self, quorum: int) -> list[Contribution]:
        """The merge failed: the round starts again with the parts still ready; returns the
        contributions the merge held."""
        self._expect("merging")
        given_back, self._merging, self._phase = list(self._merging), (), "open"
        self._open_round(self._round.opened_at, quorum)
        return given_back

    def _open_round(self, now: float, quorum: int) -> None:
        """Start the round of the current version with whatever is still pending."""
        ready = sorted(
            (c for c in self._parts.pending.values() if self.ready(c)), key=lambda c: c.received_at
        )
        self._round = policy.open_round(self.index, self.version, ready[0].received_at if ready else now)
        for c in ready:
            self._round = policy.add_contribution(self._round, round_entry(c), quorum=quorum)

    # -- news for long-polls ---------------------------------------------------------------------

    def round_open_for(self, learner_id: str, version: int) -> bool:
        """True when a round on ``version`` is collecting contributions and ``learner_id`` has none in it."""
        collecting = bool(self._round.pending) and self.round.version == version == self.version
        return collecting and not self.busy and learner_id not in self._parts.pending

    async def wait_newer(self, newer_than: int, timeout: float, round_for: str | None = None) -> News:
        """Wait until the version exceeds ``newer_than`` ("version"), or a round on ``newer_than`` that
        ``round_for`` has not joined opens ("round"); None on timeout."""
        return await self._served.wait(lambda: self._news(newer_than, round_for), timeout)

    def _news(self, newer_than: int, round_for: str | None) -> News:
        if self.version > newer_than:
            return "version"
        if round_for is not None and self.round_open_for(round_for, newer_than):
            return "round"
        return None
