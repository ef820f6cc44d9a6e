"""The round loop: asks the pure round policy what to do for each fragment, and runs the merges.

Fragments proceed independently: each merge is its own task (mathematics in a worker thread),
so a slow round of one fragment never holds back another. A round is published to learners only
after its commit (parameters, outer state, round log, then manifest) succeeded; during a storage
outage the commit is retried with backoff and the fragment's next round waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import anyio.to_thread
from diloco_core import rounds
from diloco_core.protocol import RoundRecord

from .contributions import ContributionDesk
from .fragment_state import Contribution, FragmentState
from .layout import FragmentRecord
from .merging import RoundOutcome, round_log, run_round

if TYPE_CHECKING:
    from .service import SyncService

log = logging.getLogger(__name__)
_EMA = 0.3


def applied_to_keep(keys: list[str], version: int, max_staleness: int) -> list[str]:
    """Idempotency keys still worth remembering: older bases would be refused as stale anyway."""
    oldest = version - max_staleness - 1
    return [k for k in keys if int(k.split("/")[2]) >= oldest]


def grace_left(svc: SyncService, fs: FragmentState, now: float) -> float | None:
    """Seconds until the open round's grace deadline, as :meth:`RoundRunner._consider` computes it
    (None while the round's quorum is not reached)."""
    quorum_at = fs.round.first_quorum_at
    if quorum_at is None:
        return None
    d, step_time = svc.diloco, svc.registry.step_time(now)
    grace = rounds.grace_window(
        step_time=step_time,
        quorum_time=max(quorum_at - fs.round.opened_at, 0.0),
        sync_time=svc.sync_time_s,
        overlap=d.overlap,
        gamma=d.grace_gamma,
        cap=rounds.grace_cap(
            step_time=step_time, cap_steps=d.grace_cap_steps, max_s=svc.settings.max_grace_s
        ),
    )
    return max(quorum_at + grace - now, 0.0)


class RoundRunner:
    def __init__(self, service: SyncService, desk: ContributionDesk) -> None:
        self.service = service
        self.desk = desk
        self._wake = asyncio.Event()
        self._stopping = False
        self._merges: set[asyncio.Task[None]] = set()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    async def run(self) -> None:
        svc = self.service
        while not self._stopping:
            self._wake.clear()
            now = svc.clock()
            next_at = now + svc.settings.tick_s
            for fs in list(svc.fragments.values()):
                deadline = self._consider(fs, now)
                if deadline is not None:
                    next_at = min(next_at, deadline)
            svc.refresh_gauges()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(next_at - svc.clock(), 0.001))
        for task in list(self._merges):
            task.cancel()

    def _consider(self, fs: FragmentState, now: float) -> float | None:
        """Start a merge when the policy says so; returns when to look again."""
        svc, d = self.service, self.service.diloco
        if fs.merging or fs.version < 0 or not fs.pending:
            return None
        step_time = svc.registry.step_time(now)
        decision = rounds.decide(
            fs.round,
            now=now,
            quorum=d.quorum,
            alive=svc.registry.alive_count(now),
            step_time=step_time,
            sync_time=svc.sync_time_s,
            overlap=d.overlap,
            gamma=d.grace_gamma,
            cap=rounds.grace_cap(
                step_time=step_time, cap_steps=d.grace_cap_steps, max_s=svc.settings.max_grace_s
            ),
            max_staleness=d.max_staleness,
        )
        for learner, reason in decision.excluded:
            dropped = fs.pending.pop(learner, None)
            if dropped is not None:
                log.warning("fragment %d: dropping contribution %s: %s", fs.index, dropped.key, reason)
                self.desk.discard(dropped)
        if decision.excluded:
            fs.open_round(fs.round.opened_at, d.quorum)
        if decision.action == "merge" and decision.participants:
            contributions = [fs.pending.pop(name) for name in decision.participants]
            fs.merging = True
            # still known while merged and committed: a resend in that window is a duplicate
            fs.in_merge = {c.key for c in contributions}
            quorum_at = fs.round.first_quorum_at if fs.round.first_quorum_at is not None else now
            timing = {
                "quorum_wait_s": max(quorum_at - fs.round.opened_at, 0.0),
                "grace_s": max(now - quorum_at, 0.0),
            }
            task = asyncio.get_running_loop().create_task(self._merge(fs, contributions, timing))
            self._merges.add(task)
            task.add_done_callback(self._merges.discard)
            return None
        return decision.deadline

    async def _merge(
        self, fs: FragmentState, contributions: list[Contribution], timing: dict[str, float]
    ) -> None:
        svc = self.service
        started = svc.clock()
        before = fs.optimizer.state_arrays()  # a failed round must not leave its momentum behind
        try:
            assert fs.params is not None
            outcome: RoundOutcome = await anyio.to_thread.run_sync(
                run_round, fs.spec, fs.params, fs.optimizer, fs.version, contributions, svc.diloco
            )
            await self._commit(fs, outcome, contributions, timing)
        except asyncio.CancelledError:
            raise
        except Exception:
            # their stored copies stay, so a restart replays them; only the memory is given back now
            fs.optimizer.load_state_arrays(before)
            log.exception(
                "fragment %d: round failed; its %d contributions wait for a restart",
                fs.index,
                len(contributions),
            )
            for c in contributions:
                self.desk.forget(c)
        finally:
            fs.merging = False
            fs.in_merge = set()  # applied by now, or given back to storage for a restart to replay
            self.wake()
        elapsed = svc.clock() - started
        svc.sync_time_s = elapsed if svc.sync_time_s == 0 else (1 - _EMA) * svc.sync_time_s + _EMA * elapsed

    async def _commit(
        self,
        fs: FragmentState,
        outcome: RoundOutcome,
        contributions: list[Contribution],
        timing: dict[str, float],
    ) -> None:
        svc, p, layout = self.service, fs.index, self.service.store.layout
        keys = [c.key for c in contributions]
        record = FragmentRecord(
            version=outcome.version,
            params_key=layout.params(p, outcome.version),
            outer_key=layout.outer(p, outcome.version) if outcome.outer_blob is not None else None,
            rounds=fs.rounds + 1,
            applied=applied_to_keep([*fs.applied, *keys], outcome.version, svc.diloco.max_staleness),
        )
        log_entry = round_log(p, outcome, contributions, timing)
        commit_started = svc.clock()
        await svc.guard.call_until_done(
            lambda: svc.store.commit_version(
                p,
                record,
                params_blob=outcome.payload,
                outer_blob=outcome.outer_blob,
                round_log=log_entry,
                count_round=True,
            ),
            what=f"commit of fragment {p} version {outcome.version}",
        )
        svc.metrics.commit_seconds.observe(svc.clock() - commit_started)
        fs.applied.extend(keys)
        fs.rounds += 1
        fs.publish(outcome.version, outcome.params, outcome.payload)
        fs.open_round(svc.clock(), svc.diloco.quorum)
        for c in contributions:
            self.desk.discard(c)
        svc.recent_rounds.append(
            RoundRecord(
                fragment=p,
                version=outcome.version,
                participants=[c.learner_id for c in contributions],
                weights=list(outcome.weights),
                base_versions=[c.base_version for c in contributions],
                finished_at=log_entry["finished_at"],
                quorum_wait_s=timing["quorum_wait_s"],
                grace_s=timing["grace_s"],
                merge_s=outcome.merge_s,
            )  # fmt: skip
        )
        svc.metrics.rounds.labels(str(p)).inc()
        svc.metrics.merge_seconds.observe(outcome.merge_s)
        svc.metrics.round_participants.observe(len(contributions))
        staleness = svc.metrics.contribution_staleness.labels(str(p))
        for c in contributions:  # merged into the version the round started from
            staleness.observe(rounds.staleness(c.base_version, outcome.version - 1))
        svc.metrics.fragment_version.labels(str(p)).set(outcome.version)
        log.info(
            "fragment %d: version %d from %s (weights %s, merge %.3fs)",
            p, outcome.version, [c.learner_id for c in contributions],
            [round(w, 3) for w in outcome.weights], outcome.merge_s,
        )  # fmt: skip
        await self._collect(p)

    async def _collect(self, p: int) -> None:
        try:
            await anyio.to_thread.run_sync(
                self.service.store.collect_garbage, p, self.service.settings.keep_versions
            )
        except Exception as exc:  # garbage stays until the next round
            log.info("fragment %d: garbage collection failed: %s", p, exc)
