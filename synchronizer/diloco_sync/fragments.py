"""The job's fragment plan and the state of every fragment this shard owns.

Empty until a plan is adopted (given at start-up, read back from storage, or sent by the first
learner to register). A lookup of a fragment answers with the protocol's errors: 404 for one the job
does not have, 421 for one another shard owns, 409 before any plan.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from diloco_core.fragments import FragmentPlan
from diloco_core.sharding import shard_of

from .errors import ApiError
from .fragment_state import FragmentState
from .settings import SyncSettings


class Fragments:
    def __init__(self, settings: SyncSettings) -> None:
        self.settings = settings
        self.plan: FragmentPlan | None = None
        self.plan_hash = ""
        self._states: dict[int, FragmentState] = {}

    def check_plan(self, plan: FragmentPlan) -> None:
        """409 ``plan_mismatch`` when ``plan`` does not fit the job's settings."""
        d = self.settings.job.diloco
        if (
            len(plan.fragments) != d.fragments
            or plan.inner_steps != d.inner_steps
            or plan.overlap != d.overlap
        ):
            raise ApiError(
                409,
                "plan_mismatch",
                f"plan has {len(plan.fragments)} fragments, H={plan.inner_steps}, overlap={plan.overlap}; "
                f"the job has {d.fragments} fragments, H={d.inner_steps}, overlap={d.overlap}",
            )

    def adopt(self, plan: FragmentPlan) -> None:
        """Make ``plan`` the job's plan: one uninitialised state per owned fragment."""
        self.check_plan(plan)
        self.plan, self.plan_hash = plan, plan.hash()
        for p in self.settings.owned_fragments:
            if p not in self._states:
                self._states[p] = FragmentState(spec=plan.fragments[p])

    def plan_dict(self) -> dict[str, Any]:
        assert self.plan is not None
        return self.plan.to_dict()

    def get(self, p: int) -> FragmentState:
        """The state of an owned fragment, or 404/421/409 with a reason."""
        settings = self.settings
        count = settings.job.diloco.fragments
        if not 0 <= p < count:
            raise ApiError(404, "unknown_fragment", f"fragment {p} does not exist (the job has {count})")
        if not settings.owns(p):
            owner = shard_of(p, settings.num_shards)
            raise ApiError(
                421,
                "wrong_shard",
                f"fragment {p} is served by shard {owner}, this is shard {settings.shard_index}",
            )
        fs = self._states.get(p)
        if fs is None:
            raise ApiError(409, "no_plan", "no learner has registered a fragment plan yet: register first")
        return fs

    def find(self, p: int) -> FragmentState | None:
        """The state of fragment ``p`` if this shard has one (no error)."""
        return self._states.get(p)

    def __iter__(self) -> Iterator[FragmentState]:
        return iter(list(self._states.values()))

    def versions(self) -> dict[int, int]:
        """The current version of every owned fragment (-1: none yet)."""
        return {
            p: (self._states[p].version if p in self._states else -1) for p in self.settings.owned_fragments
        }

    def uninitialised(self) -> list[int]:
        """Owned fragments with no parameters that nobody is initialising right now."""
        return [
            p
            for p in self.settings.owned_fragments
            if p not in self._states or self._states[p].phase == "uninitialised"
        ]

    def initial_digests(self) -> dict[int, str]:
        """The digest of version 0 of every owned fragment still at it."""
        return {
            p: d
            for p in self.settings.owned_fragments
            if p in self._states and (d := self._states[p].served.initial_digest) is not None
        }
