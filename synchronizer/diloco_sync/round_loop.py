"""The round loop: asks the round policy what to do for each fragment, and runs the merges.

Fragments proceed independently: each merge is its own task (mathematics in a worker thread),
so a slow round of one fragment never holds back another's intake. From its mathematics to its
commit a round holds several copies of its fragment; the rounds in progress together are bounded by
``round_memory.RoundMemory``. A round is published to learners only
after its commit (parameters, outer state, round log, then manifest) succeeded; during a storage
outage the commit is retried with backoff and the fragment's next round waits for it. A round that
fails leaves its fragment as it was (the mathematics returns new state and edits none).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any, Protocol

import anyio.to_thread
from diloco_core.config import DiLoCoSettings
from diloco_core.screening import Checked

from .commit import Committer
from .contribution import Contribution, let_go
from .fragment_state import FragmentState
from .fragments import Fragments
from .held_state import InStorage
from .merging import NothingMerged, RoundOutcome, run_round
from .persistence import StateMismatch
from .round_memory import RoundMemory, round_cost
from .round_policy import RoundPolicy

log = logging.getLogger(__name__)


class ContributionRelease(Protocol):
    """What the runner does with the contributions of a round: free what they hold."""

    def discard(self, c: Contribution) -> None:
        """Merged or excluded: free its memory and its stored copy."""

    def forget(self, c: Contribution) -> None:
        """The round failed: free its memory only (its stored copy stays for a restart)."""


class RoundRunner:
    def __init__(
        self,
        diloco: DiLoCoSettings,
        fragments: Fragments,
        policy: RoundPolicy,
        committer: Committer,
        release: ContributionRelease,
        *,
        clock: Callable[[], float],
        tick_s: float,
        on_tick: Callable[[], None] = lambda: None,
        on_excluded: Callable[[int, int], None] = lambda _p, _n: None,
        on_clipped: Callable[[int, int], None] = lambda _p, _n: None,
        round_memory: RoundMemory | None = None,
    ) -> None:
        self.diloco, self.fragments, self.policy = diloco, fragments, policy
        self.committer, self.release = committer, release
        self.clock, self.tick_s, self.on_tick = clock, tick_s, on_tick
        self.on_excluded = on_excluded  # (fragment, how many) contributions a round's checks excluded
        self.on_clipped = on_clipped  # (fragment, how many) contributions merged scaled down to their limit
        self._wake = asyncio.Event()
        self._stopping = False
        self._merges: set[asyncio.Task[None]] = set()
        self.memory = round_memory or RoundMemory(0)  # from the mathematics to the commit

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    async def run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            next_at = self.tick()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(next_at - self.clock(), 0.001))
        for task in list(self._merges):
            task.cancel()

    def tick(self) -> float:
        """Consider every fragment once; returns when to look again at the latest."""
        now = self.clock()
        next_at = now + self.tick_s
        for fs in self.fragments:
            deadline = self.consider(fs, now)
            if deadline is not None:
                next_at = min(next_at, deadline)
        self.on_tick()
        return next_at

    def consider(self, fs: FragmentState, now: float) -> float | None:
        """Start a merge when the policy says so; returns when to look again (None: on news)."""
        if fs.phase != "open" or not fs.pending:
            return None
        for gapped in fs.drop_stale_gaps(self.diloco.max_staleness):
            log.warning(
                "fragment %d: dropping contribution %s: its base is stale and learner %s never resent "
                "its progress before step %d",
                fs.index,
                gapped.key,
                gapped.learner_id,
                gapped.since,
            )
            self.release.discard(gapped)
        decision = self.policy.decide(fs.round, now)
        if decision.excluded:
            dropped = fs.exclude([learner for learner, _ in decision.excluded], self.diloco.quorum)
            for learner, reason in decision.excluded:
                if (c := dropped.get(learner)) is not None:
                    log.warning("fragment %d: dropping contribution %s: %s", fs.index, c.key, reason)
                    self.release.discard(c)
        if decision.action == "merge" and decision.participants:
            quorum_at = fs.round.first_quorum_at if fs.round.first_quorum_at is not None else now
            timing = {
                "quorum_wait_s": max(quorum_at - fs.round.opened_at, 0.0),
                "grace_s": max(now - quorum_at, 0.0),
            }
            contributions = fs.start_merge(decision.participants)
            task = asyncio.get_running_loop().create_task(self._merge(fs, contributions, timing))
            self._merges.add(task)
            task.add_done_callback(self._merges.discard)
            return None
        return decision.deadline

    async def _merge(
        self, fs: FragmentState, contributions: list[Contribution], timing: dict[str, float]
    ) -> None:
        started = self.clock()
        try:
            state = fs.state.for_round()
            async with self.memory.reserve(round_cost(fs.spec.numel, isinstance(state, InStorage))):
                if isinstance(state, InStorage):  # a version served from storage: read its state back
                    state = await self.committer.read_state(fs.spec, state)
                params, outer = state
                outcome = await anyio.to_thread.run_sync(
                    run_round,
                    fs.spec,
                    params,
                    outer,
                    fs.version,
                    contributions,
                    self.diloco,
                    fs.norms,
                    self.committer.encodes_in_round(fs.spec),
                )
                del state, params, outer  # the round holds its new state, not the old one too
                self._report_excluded(fs, outcome.excluded)
                if isinstance(outcome, NothingMerged):
                    for c in fs.reject(self.diloco.quorum):
                        self.release.discard(c)
                    return
                log_entry, size = await self.committer.write(fs, outcome, list(outcome.merged), timing)
        except asyncio.CancelledError:
            raise
        except StateMismatch as exc:  # the prefix is another job's now: the server stops with the reason
            log.error("fragment %d: round not committed: %s", fs.index, exc)
            for c in fs.abort(self.diloco.quorum):
                self.release.forget(c)
        except Exception:
            # their stored copies stay, so a restart replays them; only the memory is given back now
            log.exception(
                "fragment %d: round failed; its %d contributions wait for a restart",
                fs.index,
                len(contributions),
            )
            for c in fs.abort(self.diloco.quorum):
                self.release.forget(c)
        else:
            await self._publish(fs, outcome, contributions, log_entry, size)
        finally:
            self.wake()
        self.policy.record_sync_time(self.clock() - started)

    def _report_excluded(self, fs: FragmentState, excluded: tuple[tuple[Contribution, str], ...]) -> None:
        for c, reason in excluded:
            log.warning(
                "fragment %d: contribution %s of learner %s excluded from the round: %s",
                fs.index,
                c.key,
                c.learner_id,
                reason,
            )
        if excluded:
            self.on_excluded(fs.index, len(excluded))

    def _report_clipped(self, fs: FragmentState, outcome: RoundOutcome) -> None:
        for c, reason in outcome.clipped:
            log.warning(
                "fragment %d: contribution %s of learner %s merged scaled down: %s",
                fs.index,
                c.key,
                c.learner_id,
                reason,
            )
        if outcome.update_clipped:
            log.warning(
                "fragment %d: the merged update was scaled down: %s", fs.index, outcome.update_clipped
            )
        if outcome.clipped:
            self.on_clipped(fs.index, len(outcome.clipped))

    async def _publish(
        self,
        fs: FragmentState,
        outcome: RoundOutcome,
        contributions: list[Contribution],
        log_entry: dict[str, Any],
        size: int,
    ) -> None:
        """The round is durable: make it current (its version's object ``size`` bytes long), let its
        contributions' outer gradients go, record it, then tidy the fragment's storage."""
        result = outcome.result
        fs.commit(
            version=result.version,
            params=result.params,
            payload=self.committer.served(fs.index, outcome, size),
            outer=result.outer,
            now=self.clock(),
            quorum=self.diloco.quorum,
            norms=outcome.norms,
            checked=Checked(len(outcome.excluded), len(outcome.clipped)),
            update=result.down_blob,
            merged={c.key for c in outcome.merged},
            outer_key=self.committer.outer_key(fs.index, result.version),
        )
        let_go(contributions)  # merged: not held while the fragment's storage is tidied
        self._report_clipped(fs, outcome)
        try:
            for c in contributions:
                self.release.discard(c)
            self.committer.record(fs.index, outcome, list(outcome.merged), log_entry)
            # the next merge of this fragment waits: it must not write while old versions are deleted
            await self.committer.collect(fs.index)
        finally:
            fs.settle()
