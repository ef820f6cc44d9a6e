"""Making a merged round durable, and recording it once it is.

The commit writes the new parameters, the outer state and the round log, then the manifest that
makes them current (``StateStore.commit_version``); during a storage outage it is retried with
backoff until it succeeds. Only then is the round published (by the round runner) and recorded here:
the status's recent rounds, the metrics, the log line. Old versions are collected afterwards.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import anyio.to_thread
from diloco_core.fragments import Fragment
from diloco_core.layout import FragmentRecord, key_base_version
from diloco_core.outer import OuterState
from diloco_core.protocol import RoundRecord
from diloco_core.tracking import Tracking

from .contribution import Arrays, Contribution, merged_through
from .fragment_state import FragmentState
from .held_state import InStorage, read_state
from .merging import RoundOutcome, round_log, round_record, round_scalars, write_outer_state, write_version
from .metrics import Metrics
from .object_writes import Contents
from .pace import kept_times
from .persistence import StateStore
from .publication import DEFAULT_SERVED_IN_MEMORY, Served, Stored, served_form, served_from_storage
from .storage_guard import StorageGuard

log = logging.getLogger(__name__)


def applied_to_keep(keys: list[str], version: int, max_staleness: int) -> list[str]:
    """Idempotency keys still worth remembering: older bases would be refused as stale anyway."""
    oldest = version - max_staleness - 1
    return [k for k in keys if key_base_version(k) >= oldest]


class Committer:
    def __init__(
        self,
        store: StateStore,
        guard: StorageGuard,
        metrics: Metrics,
        recent_rounds: deque[RoundRecord],
        *,
        max_staleness: int,
        keep_versions: int,
        clock: Callable[[], float],
        tracking: Tracking | None = None,
        served_in_memory_bytes: int = DEFAULT_SERVED_IN_MEMORY,
    ) -> None:
        self.store, self.guard, self.metrics = store, guard, metrics
        self.served_in_memory_bytes = served_in_memory_bytes
        self.tracking = tracking
        self.recent_rounds = recent_rounds
        self.max_staleness, self.keep_versions = max_staleness, keep_versions
        self.clock = clock

    async def write(
        self,
        fs: FragmentState,
        outcome: RoundOutcome,
        contributions: Sequence[Contribution],
        timing: dict[str, float],
    ) -> tuple[dict[str, Any], int]:
        """Write the round's objects and the manifest, retrying through outages; returns the round log
        and the size of the new version's object (encoded here as it is written when the round left
        it to the commit: ``RoundOutcome.payload`` None)."""
        p, layout, version = fs.index, self.store.layout, outcome.result.version
        taken = [*contributions, *(c for c, _ in outcome.excluded)]  # an excluded key is never taken again
        keys = [part.key for c in taken for part in c.received()]
        oldest = version - self.max_staleness - 1
        record = FragmentRecord(
            version=version,
            params_key=layout.params(p, version),
            outer_key=self.outer_key(p, version),
            params_bytes=None if outcome.payload is None else len(outcome.payload),
            rounds=fs.rounds + 1,
            applied=applied_to_keep([*fs.applied, *keys], version, self.max_staleness),
            merged_through={
                learner: at
                for learner, at in merged_through(fs.merged_through, contributions).items()
                if at[0] >= oldest
            },
            contribution_norms=list(outcome.norms.contributions),
            update_norms=list(outcome.norms.updates),
            reference_norm=outcome.norms.reference,
            version_times=kept_times(fs.version_times, version, self.clock()),
        )
        log_entry = round_log(p, outcome, contributions, timing)
        params: Contents = (
            outcome.payload
            if outcome.payload is not None
            else partial(write_version, params=outcome.result.params, fragment=p, version=version)
        )
        started = self.clock()
        committed = await self.guard.call_until_done(
            lambda: self.store.commit_version(
                p,
                record,
                params_blob=params,
                outer=partial(write_outer_state, state=outcome.result.outer, fragment=p, version=version),
                round_log=log_entry,
                count_round=True,
            ),
            what=f"commit of fragment {p} version {version}",
        )
        self.metrics.commit_seconds.observe(self.clock() - started)
        return log_entry, committed.params_bytes or 0

    def outer_key(self, p: int, version: int) -> str:
        """The object of fragment ``p``'s outer state at ``version``, as a commit writes it."""
        return self.store.layout.outer(p, version)

    async def read_state(self, spec: Fragment, at: InStorage) -> tuple[Arrays, OuterState]:
        """A fragment's parameters and outer state, read back for its round from the objects that hold
        them (``held_state``), retrying through outages like a commit."""
        started = self.clock()
        state = await self.guard.call_until_done(
            read_state, self.store, spec, at, what=f"reading the state of fragment {spec.index}"
        )
        self.metrics.state_read_seconds.observe(self.clock() - started)
        return state

    def encodes_in_round(self, spec: Fragment) -> bool:
        """Whether a round of this fragment encodes its new version (one served from memory), rather
        than leave it to the commit (``publication.served_from_storage``)."""
        return not served_from_storage(spec, self.served_in_memory_bytes)

    def served(self, p: int, outcome: RoundOutcome, size: int) -> Served:
        """The new version as fragment ``p`` serves it once committed, ``size`` bytes long
        (``publication.served_form``; where the commit encoded it, from its object)."""
        key = self.store.layout.params(p, outcome.result.version)
        if outcome.payload is None:
            return Stored(key, size)
        return served_form(outcome.payload, key, self.served_in_memory_bytes)

    def record(
        self,
        p: int,
        outcome: RoundOutcome,
        contributions: Sequence[Contribution],
        log_entry: dict[str, Any],
    ) -> None:
        """A committed round: into the status's recent rounds, the metrics and the log."""
        result = outcome.result
        self.recent_rounds.append(round_record(log_entry))  # as a restart reads it back
        m = self.metrics
        m.rounds.labels(str(p)).inc()
        m.merge_seconds.observe(outcome.merge_s)
        m.round_participants.observe(len(contributions))
        staleness = m.contribution_staleness.labels(str(p))
        for lag in result.staleness:  # behind the version the round started from
            staleness.observe(lag)
        m.fragment_version.labels(str(p)).set(result.version)
        if self.tracking is not None:
            self.tracking.log(result.version, round_scalars(log_entry))
        log.info(
            "fragment %d: version %d from %s (steps %s, tokens %s, weights %s, %d excluded, %d clipped, "
            "update norm %.4g, "
            "merge %.3fs)",
            p,
            result.version,
            log_entry["participants"],
            log_entry["steps"],
            log_entry["tokens"],
            [round(w, 3) for w in result.weights],
            len(outcome.excluded),
            len(outcome.clipped),
            log_entry["update_norm"],
            outcome.merge_s,
        )

    async def collect(self, p: int) -> None:
        """Delete the fragment's versions older than the ones kept; a failure only waits for the next round."""
        try:
            await anyio.to_thread.run_sync(self.store.collect_garbage, p, self.keep_versions)
        except Exception as exc:  # garbage stays until the next round
            log.info("fragment %d: garbage collection failed: %s", p, exc)
