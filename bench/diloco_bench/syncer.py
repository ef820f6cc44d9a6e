"""The synchronizer in virtual time: each fragment is the synchronizer service's own
``diloco_sync.fragment_state.FragmentState`` (what waits, continuations, the round, exclusions, the
in-order checks), the round policy (``diloco_core.rounds``) decides when it merges, and the round the
service runs (``diloco_core.screening.screened_round``: the checks and the norm bound with its history,
then ``diloco_core.round_math``'s token and staleness weights, RDA or mean, Nesterov or Delayed
Nesterov) computes each new version."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np
from diloco_core import codec, rounds
from diloco_core.codec import encode_params
from diloco_core.config import DiLoCoSettings
from diloco_core.fragments import FragmentPlan
from diloco_core.learner import Sent
from diloco_core.outer import OuterState
from diloco_core.round_math import RoundResult
from diloco_core.screening import Checked, screened_round, tensors_norm
from diloco_sync.contribution import Contribution
from diloco_sync.fragment_state import FragmentState

Arrays = dict[str, np.ndarray]


@dataclass(frozen=True)
class Upload:
    """One learner's send of one fragment: what it carries by the learner's counting rules
    (``diloco_core.learner.Sent``: its base, the steps after ``since``, tokens, sequence number) and
    its outer gradient as the synchronizer decodes it."""

    learner: int
    sent: Sent
    tensors: Arrays


@dataclass(frozen=True)
class Release:
    """A new global version of a fragment: its values and the payload that takes it to the learners."""

    version: int
    params: Arrays
    blob: bytes
    update: bool = False  # the blob is the difference to the previous version (``diloco_core.downlink``)


class Syncer:
    """Every fragment's state as the service keeps it, its grace deadline, and ``alive`` learners."""

    def __init__(
        self,
        settings: DiLoCoSettings,
        alive: int,
        plan: FragmentPlan,
        params: Arrays,
        block_size: int = codec.q.DEFAULT_BLOCK_SIZE,
    ) -> None:
        """``block_size``: the block of a blocked download codec (``settings.down_codec``)."""
        self.settings, self.alive, self.plan = settings, alive, plan
        self.block_size = block_size
        self.fragments = [FragmentState(f) for f in plan.fragments]
        for fs in self.fragments:
            fs.restore(
                version=0,
                params={n: params[n].copy() for n in fs.spec.names},
                payload=b"",  # the harness hands versions over as ``Release``
                outer=OuterState(),
                applied=(),
                rounds=0,
                now=0.0,
                quorum=settings.quorum,
            )
        self.deadlines: list[float | None] = [None] * len(plan.fragments)
        self.step_time = 1.0
        self.rounds = 0
        self.participants = 0
        self.merged_steps = 0.0  # learner-steps, weighted by the fragment's share of the model
        self.norm_ratios: list[float] = []
        self.refused = 0  # contributions the in-order checks refused

    @property
    def global_params(self) -> Arrays:
        return {n: v for fs in self.fragments for n, v in (fs.state.params or {}).items()}

    @property
    def versions(self) -> list[int]:
        return [fs.version for fs in self.fragments]

    @property
    def outer(self) -> list[OuterState]:
        return [fs.state.outer for fs in self.fragments]

    @property
    def excluded(self) -> int:
        """Contributions the rounds' checks excluded."""
        return sum(fs.checked.excluded for fs in self.fragments)

    @property
    def clipped(self) -> int:
        """Contributions the rounds' checks merged scaled down to their norm limit."""
        return sum(fs.checked.clipped for fs in self.fragments)

    def round_for(self, p: int, learner: int) -> int | None:
        """The version of fragment ``p``'s round that is open without ``learner`` in it (the rule the
        service's long-poll announces rounds by), or None."""
        fs = self.fragments[p]
        return fs.round.version if fs.round_open_for(str(learner), fs.version) else None

    def submit(self, p: int, upload: Upload, now: float) -> Release | None:
        """Take a learner's progress (it adds to its pending progress on the same base) and merge if
        the round policy says so."""
        self.queue(p, upload, now)
        return self.consider(p, now)

    def queue(self, p: int, upload: Upload, now: float) -> str | None:
        """Take a learner's progress without asking the round policy (the final flush), checked as
        the service checks every contribution (in order, each step once); returns the code of a
        refusal (the progress is dropped, as a worker holding no earlier part drops it), else None."""
        fs, learner, sent = self.fragments[p], str(upload.learner), upload.sent
        refused: tuple[int, str, str] | None = fs.refusal(
            learner, sent.base_version, sent.since, sent.steps, sent.tokens
        )
        if refused is not None:
            self.refused += 1
            return refused[1]
        c = Contribution(
            learner_id=learner,
            fragment=p,
            base_version=sent.base_version,
            seq=sent.seq,
            steps=sent.steps,
            tokens=sent.tokens,
            tensors=upload.tensors,
            nbytes=0,
            received_at=now,
            since=sent.since,
        )
        fs.accept(c, self.settings.quorum)
        return None

    def consider(self, p: int, now: float) -> Release | None:
        """Merge fragment ``p`` if the round policy says so; returns the new version as it goes down."""
        fs, s = self.fragments[p], self.settings
        if not fs.pending:
            return None
        d = rounds.decide(
            fs.round,
            now=now,
            quorum=s.quorum,
            alive=self.alive,
            step_time=self.step_time,
            sync_time=0.0,
            overlap=s.overlap,
            gamma=s.grace_gamma,
            cap=s.grace_cap_steps * self.step_time,
            max_staleness=s.max_staleness,
        )
        if d.excluded:
            fs.exclude([learner for learner, _ in d.excluded], s.quorum)
        if d.action == "wait":
            self.deadlines[p] = d.deadline
            return None
        return self._merge(p, fs.start_merge(d.participants), now) if d.participants else None

    def flush(self, p: int, now: float) -> Release | None:
        """At the end of a run: merge whatever fresh contributions are pending, quorum or not."""
        fs, s = self.fragments[p], self.settings
        stale = [
            n for n, c in fs.pending.items() if rounds.is_stale(c.base_version, fs.version, s.max_staleness)
        ]
        fs.exclude(stale, s.quorum)
        if not fs.pending:
            return None
        return self._merge(p, fs.start_merge(sorted(fs.pending, key=lambda n: (len(n), n))), now)

    def _merge(self, p: int, contribs: list[Contribution], now: float) -> Release | None:
        self.deadlines[p] = None
        fs = self.fragments[p]
        params, outer = fs.state.for_round()  # held in memory: the harness serves nothing from storage
        screened = screened_round(
            fs.spec,
            params,
            outer,
            fs.version,
            contribs,
            self.settings,
            fs.norms,
            down_block_size=self.block_size,
        )
        result = screened.result
        if result is None:
            fs.reject()
            return None
        merged = list(screened.merged)
        update_norm = screened.update_norm
        if (
            len(merged) > 1
            and fs.spec.kind == "dense"
            and not screened.clipped
            and not screened.update_clipped
        ):
            mean_norm = statistics.fmean(tensors_norm(c.tensors) for c in merged)
            if mean_norm > 0:
                self.norm_ratios.append(update_norm / mean_norm)
        release = self._release(p, result)
        fs.commit(
            version=result.version,
            params=release.params,
            payload=b"",
            outer=result.outer,
            now=now,
            quorum=self.settings.quorum,
            norms=screened.next_history(),
            checked=Checked(len(screened.excluded), len(screened.clipped)),
            update=result.down_blob,
            merged={c.key for c in merged},
        )
        fs.settle()
        self.rounds += 1
        self.participants += len(merged)
        self.merged_steps += sum(c.steps for c in merged) * fs.spec.numel / self.plan.num_params
        return release

    def _release(self, p: int, result: RoundResult) -> Release:
        """The new version as it goes down: whole, as the synchronizer serves it (``encode_params``),
        or (``down_codec``) the update from the previous version that the round published
        (``diloco_core.downlink``)."""
        if result.down_blob is None:
            blob = encode_params(result.params, p, result.version)
            return Release(result.version, dict(result.params), blob)
        return Release(result.version, result.params, result.down_blob, update=True)
