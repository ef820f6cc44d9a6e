"""The synchronizer in virtual time: the real round policy (``diloco_core.rounds``) decides when each
fragment merges, and the round the synchronizer service runs (``diloco_core.screening.screened_round``:
the checks and the norm bound with its history, then ``diloco_core.round_math``'s token and staleness
weights, RDA or mean, Nesterov or Delayed Nesterov) computes each new version."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np
from diloco_core import codec, rounds
from diloco_core.config import DiLoCoSettings
from diloco_core.fragments import FragmentPlan
from diloco_core.outer import OuterState
from diloco_core.round_math import RoundResult
from diloco_core.screening import NormHistory, screened_round, tensors_norm

Arrays = dict[str, np.ndarray]


@dataclass
class Pending:
    """A contribution waiting for its fragment's next round."""

    learner: int
    base_version: int
    steps: int
    tokens: int
    tensors: Arrays


@dataclass(frozen=True)
class Release:
    """A new global version of a fragment: its values and the payload that takes it to the learners."""

    version: int
    params: Arrays
    blob: bytes
    update: bool = False  # the blob is the difference to the previous version (``diloco_core.downlink``)


class Syncer:
    """Every fragment's version, outer state, pending contributions and open round; ``alive`` learners."""

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
        self.global_params = {n: v.copy() for n, v in params.items()}
        P = len(plan.fragments)
        self.versions = [0] * P
        self.outer = [OuterState() for _ in range(P)]
        self.pending: list[dict[int, Pending]] = [{} for _ in range(P)]
        self.state: list[rounds.RoundState | None] = [None] * P
        self.deadlines: list[float | None] = [None] * P
        self.step_time = 1.0
        self.rounds = 0
        self.participants = 0
        self.merged_steps = 0.0  # learner-steps, weighted by the fragment's share of the model
        self.norm_ratios: list[float] = []
        self.norms = [NormHistory() for _ in range(P)]  # per fragment, as the synchronizer commits it
        self.excluded = 0  # contributions the checks refused

    def fragment(self, p: int) -> Arrays:
        return {n: self.global_params[n] for n in self.plan.fragments[p].names}

    def submit(self, p: int, c: Pending, now: float) -> Release | None:
        """Queue a contribution (the progress after the learner's previous send on its base: it adds
        to a pending one on the same base) and merge if the round policy says so."""
        c = self.queue(p, c)
        self._add(p, c, now)
        return self.consider(p, now)

    def queue(self, p: int, c: Pending) -> Pending:
        """Put a contribution among fragment ``p``'s pending ones without asking the round policy
        (the final flush); a pending one of the same learner on the same base takes it as a
        continuation. Returns what is now pending for that learner."""
        previous = self.pending[p].get(c.learner)
        if previous is not None and previous.base_version == c.base_version:
            summed = {n: previous.tensors[n] + c.tensors[n] for n in c.tensors}
            c = Pending(
                c.learner, c.base_version, previous.steps + c.steps, previous.tokens + c.tokens, summed
            )
        self.pending[p][c.learner] = c
        return c

    def consider(self, p: int, now: float) -> Release | None:
        """Merge fragment ``p`` if the round policy says so; returns the new version as it goes down."""
        state = self.state[p]
        if state is None:
            return None
        s = self.settings
        d = rounds.decide(
            state,
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
            for learner, _ in d.excluded:
                self.pending[p].pop(int(learner), None)
            self.state[p] = rounds.open_round(p, self.versions[p], state.opened_at)
            for c in self.pending[p].values():
                self._add(p, c, state.opened_at)
        if d.action == "wait":
            self.deadlines[p] = d.deadline
            return None
        return self._merge(p, [self.pending[p].pop(int(n)) for n in d.participants])

    def flush(self, p: int) -> Release | None:
        """At the end of a run: merge whatever fresh contributions are pending, quorum or not."""
        fresh = [
            c
            for c in self.pending[p].values()
            if not rounds.is_stale(c.base_version, self.versions[p], self.settings.max_staleness)
        ]
        self.pending[p] = {}
        return self._merge(p, sorted(fresh, key=lambda c: c.learner))

    def _add(self, p: int, c: Pending, now: float) -> None:
        state = self.state[p] or rounds.open_round(p, self.versions[p], now)
        entry = rounds.RoundEntry(str(c.learner), c.base_version, c.steps, c.tokens, now)
        self.state[p] = rounds.add_contribution(
            state, entry, quorum=self.settings.quorum, max_staleness=self.settings.max_staleness
        )

    def _merge(self, p: int, contribs: list[Pending]) -> Release | None:
        self.deadlines[p], self.state[p] = None, None
        if not contribs:
            return None
        frag = self.plan.fragments[p]
        screened = screened_round(
            frag,
            self.fragment(p),
            self.outer[p],
            self.versions[p],
            contribs,
            self.settings,
            self.norms[p],
            down_block_size=self.block_size,
        )
        self.excluded += len(screened.excluded)
        result = screened.result
        if result is None:
            return None
        self.norms[p] = screened.history.after(screened.norms, tensors_norm(result.update))
        contribs = list(screened.merged)
        if len(contribs) > 1 and frag.kind == "dense":
            mean_norm = statistics.fmean(_norm(c.tensors) for c in contribs)
            if mean_norm > 0:
                self.norm_ratios.append(_norm(result.update) / mean_norm)
        release = self._release(p, result)
        self.global_params.update(release.params)
        self.outer[p], self.versions[p] = result.outer, result.version
        self.rounds += 1
        self.participants += len(contribs)
        self.merged_steps += sum(c.steps for c in contribs) * frag.numel / self.plan.num_params
        return release

    def _release(self, p: int, result: RoundResult) -> Release:
        """The new version as it goes down: whole in fp32, or (``down_codec``) the update from the
        previous version that the round published (``diloco_core.downlink``)."""
        if result.down_blob is None:
            blob = codec.encode(
                result.params, fragment=p, base_version=result.version, kind="params", quantizer="fp32"
            )
            return Release(result.version, dict(result.params), blob)
        return Release(result.version, result.params, result.down_blob, update=True)


def _norm(arrays: Arrays) -> float:
    return math.sqrt(
        sum(
            float(np.dot(v.ravel().astype(np.float64), v.ravel().astype(np.float64))) for v in arrays.values()
        )
    )
