"""The synchronizer's round policy for one fragment, as pure functions of (state, now).

A round of fragment p at version v collects contributions (outer gradients based on some version).
Contributions whose base version is more than ``max_staleness`` versions behind are excluded with a
reason. Once the quorum K is reached at ``first_quorum_at``, the round waits an adaptive grace window
(Decoupled DiLoCo Eq. 3, docs/algorithm.md §2.4, §3.5)::

    grace = clip(gamma * (overlap * step_time - quorum_time - sync_time), 0, cap)

with ``quorum_time = first_quorum_at - opened_at``; it merges at ``first_quorum_at + grace`` with
everyone who arrived by then, or at once when every alive learner has contributed. With fewer than K
contributions the round waits (no deadline): it never merges below the quorum.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal


@dataclass(frozen=True)
class RoundEntry:
    """What the round knows about one learner's contribution (the payload itself lives elsewhere)."""

    learner: str
    base_version: int
    steps: int
    tokens: int
    arrived_at: float


@dataclass(frozen=True)
class RoundState:
    fragment: int
    version: int
    opened_at: float
    first_quorum_at: float | None = None
    pending: Mapping[str, RoundEntry] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    action: Literal["wait", "merge"]
    deadline: float | None
    participants: tuple[str, ...]
    excluded: tuple[tuple[str, str], ...] = ()
    """(learner, reason) of pending contributions left out of this round."""


def staleness(base_version: int, current_version: int) -> int:
    """How many versions a contribution's base is behind the fragment's current version."""
    return max(current_version - base_version, 0)


def is_stale(base_version: int, current_version: int, max_staleness: int) -> bool:
    return staleness(base_version, current_version) > max_staleness


def grace_window(
    *, step_time: float, quorum_time: float, sync_time: float, overlap: int, gamma: float, cap: float
) -> float:
    """Seconds to wait after the quorum: a share ``gamma`` of the slack the overlap leaves, at most
    ``cap`` (0 when any input is not a number)."""
    window = min(max(gamma * (overlap * step_time - quorum_time - sync_time), 0.0), max(cap, 0.0))
    return window if window == window else 0.0  # NaN in, no wait out


def grace_cap(*, step_time: float, cap_steps: float, max_s: float) -> float:
    """The grace window's cap: ``cap_steps`` step times, and never more than ``max_s`` seconds.

    Step times are what learners report, so ``max_s`` (the synchronizer's own setting) is what
    bounds the wait whatever they report."""
    cap = cap_steps * step_time
    return min(cap, max_s) if cap == cap else 0.0


def grace_deadline(
    state: RoundState,
    quorum_at: float,
    *,
    step_time: float,
    sync_time: float,
    overlap: int,
    gamma: float,
    cap: float,
) -> float:
    """When a round whose quorum was reached at ``quorum_at`` stops waiting for more contributions."""
    return quorum_at + grace_window(
        step_time=step_time,
        quorum_time=max(quorum_at - state.opened_at, 0.0),
        sync_time=sync_time,
        overlap=overlap,
        gamma=gamma,
        cap=cap,
    )


def grace_left(
    state: RoundState,
    *,
    now: float,
    step_time: float,
    sync_time: float,
    overlap: int,
    gamma: float,
    cap: float,
) -> float | None:
    """Seconds from ``now`` until the round's grace deadline, as :func:`decide` sets it (None while
    the round's quorum is not reached)."""
    if state.first_quorum_at is None:
        return None
    deadline = grace_deadline(
        state,
        state.first_quorum_at,
        step_time=step_time,
        sync_time=sync_time,
        overlap=overlap,
        gamma=gamma,
        cap=cap,
    )
    return max(deadline - now, 0.0)


def open_round(fragment: int, version: int, now: float) -> RoundState:
    return RoundState(fragment=fragment, version=version, opened_at=now)


def add_contribution(
    state: RoundState, contribution: RoundEntry, *, quorum: int, max_staleness: int | None = None
) -> RoundState:
    """The state with ``contribution`` added (replacing the learner's earlier one) and the quorum time set."""
    pending = {**state.pending, contribution.learner: contribution}
    new = replace(state, pending=pending)
    if state.first_quorum_at is None and len(_fresh(new, max_staleness)[0]) >= quorum:
        new = replace(new, first_quorum_at=contribution.arrived_at)
    return new


def _fresh(state: RoundState, max_staleness: int | None) -> tuple[list[RoundEntry], list[tuple[str, str]]]:
    fresh: list[RoundEntry] = []
    excluded: list[tuple[str, str]] = []
    for learner in sorted(state.pending):
        c = state.pending[learner]
        if c.base_version > state.version:
            excluded.append(
                (learner, f"base version {c.base_version} is newer than the current {state.version}")
            )
        elif max_staleness is not None and is_stale(c.base_version, state.version, max_staleness):
            lag = staleness(c.base_version, state.version)
            excluded.append(
                (learner, f"stale: base version {c.base_version} is {lag} behind (max {max_staleness})")
            )
        else:
            fresh.append(c)
    return fresh, excluded


def decide(
    state: RoundState,
    *,
    now: float,
    quorum: int,
    alive: int,
    step_time: float,
    sync_time: float,
    overlap: int,
    gamma: float,
    cap: float,
    max_staleness: int | None = None,
) -> Decision:
    """Whether to merge now, and with whom; ``deadline`` is when to ask again (None: on next arrival)."""
    if quorum < 1:
        raise ValueError(f"quorum must be >= 1, got {quorum}")
    fresh, excluded = _fresh(state, max_staleness)
    names = tuple(c.learner for c in fresh)
    if len(fresh) < quorum:
        return Decision("wait", None, (), tuple(excluded))
    if len(fresh) >= alive:
        return Decision("merge", now, names, tuple(excluded))
    quorum_at = state.first_quorum_at if state.first_quorum_at is not None else now
    deadline = grace_deadline(
        state, quorum_at, step_time=step_time, sync_time=sync_time, overlap=overlap, gamma=gamma, cap=cap
    )
    if now < deadline:
        return Decision("wait", deadline, (), tuple(excluded))
    # whoever arrived between the deadline and this call joins too: more contributions, less variance
    return Decision("merge", deadline, names, tuple(excluded))
