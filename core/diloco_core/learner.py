"""Learner-side DiLoCo state as pure functions on numpy arrays (docs/algorithm.md §3.3).

Per fragment a learner keeps an anchor (the last global version it received), a step counter that
starts at ``-offset`` so fragments fall due at different steps, the tokens seen since the fragment's
last sync, the base version its outer gradient is relative to, and when it last sent it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from diloco_core.config import SCHEDULES, Schedule
from diloco_core.fragments import FragmentPlan
from diloco_core.tensor_match import check_same_tensors

F32 = npt.NDArray[np.float32]


def outer_gradient(
    anchor: Mapping[str, npt.NDArray[np.floating]], params: Mapping[str, npt.NDArray[np.floating]]
) -> dict[str, F32]:
    """``anchor - params`` per tensor (the sign the outer optimizer expects)."""
    check_same_tensors(anchor, params, ("anchor", "params"))
    out = {}
    for name in anchor:
        out[name] = np.asarray(anchor[name], np.float32) - np.asarray(params[name], np.float32)
    return out


def apply_global(
    params: Mapping[str, npt.NDArray[np.floating]],
    global_params: Mapping[str, npt.NDArray[np.floating]],
    alpha: float,
) -> dict[str, F32]:
    """``alpha * params + (1 - alpha) * global``; alpha = 0 overwrites the local values (the default)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    check_same_tensors(params, global_params, ("params", "global"))
    out = {}
    for name, g in global_params.items():
        g32 = np.asarray(g, np.float32)
        out[name] = (
            g32.copy()
            if alpha == 0.0
            else np.float32(alpha) * np.asarray(params[name], np.float32) + np.float32(1.0 - alpha) * g32
        )
    return out


_COUNTER_FIELDS = ("base_version", "steps", "tokens", "sent_at", "sent_tokens", "seq", "since_send")


@dataclass
class FragmentCounter:
    """One fragment's counters on a learner, since the last global version of it the learner took."""

    base_version: int = -1  # the version its outer gradient is relative to (-1: none yet)
    steps: int = 0  # inner steps since that version (starts at -offset)
    tokens: int = 0  # tokens trained on in those steps (counted once ``steps`` passed zero)
    sent_at: int = 0  # value of ``steps`` at the last send since that version (0: not sent)
    sent_tokens: int = 0  # value of ``tokens`` at that send
    seq: int = 0  # idempotency sequence of the contributions (never reset)
    since_send: int = 0  # inner steps since the fragment's last send, whatever arrived (starts at -offset)

    def to_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _COUNTER_FIELDS}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FragmentCounter:
        """What :meth:`to_dict` wrote (missing fields take their defaults)."""
        unknown = set(d) - set(_COUNTER_FIELDS)
        if unknown:
            raise ValueError(f"malformed fragment counter: unknown fields {sorted(unknown)}")
        try:
            return cls(**{k: int(v) for k, v in d.items()})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed fragment counter {dict(d)!r}: {exc}") from exc


@dataclass(frozen=True)
class Sent:
    """What one send of a fragment carries: the progress since the previous send on the same base
    version (or since that version, for the first), so no step is ever sent twice."""

    base_version: int
    since: int  # the step (counted from the base version) of the previous send on it; 0: none
    steps: int  # inner steps after ``since``
    tokens: int  # tokens trained on in those steps
    seq: int

    @property
    def through(self) -> int:
        """The step (counted from the base version) this send's progress reaches."""
        return self.since + self.steps


class FragmentCounters:
    """The fragment counters of one learner, and the rules that move them.

    - Every counter starts at ``-offset``, so the fragments fall due at different steps; tokens are
      counted only for steps after the counter passed zero, so ``tokens / steps`` is the learner's
      tokens per step on the first round too.
    - ``schedule="fixed"`` (the default, the papers' schedule): fragment p is due when the learner's
      step t satisfies ``t mod H = t_p`` (counted per fragment by ``since_send``), whenever its
      merged version arrived.
    - ``schedule="after-version"``: a fragment is due when its H inner steps since the last global
      version are done, and, once sent, again H steps after that send if the merged version has not
      come back yet (``diloco bench quality --after-version-schedule`` compares the two,
      docs/algorithm.md §3.2).
    - Either way a send carries only the progress made since the previous send on the same base
      (:class:`Sent`; the learner's anchor moved to the sent point), so progress the synchronizer
      merged already is never sent again, and nothing is sent when there is no new progress.
    - Taking a global version resets the fragment's counters but ``since_send`` (its ``seq`` goes on).

    The counting and due rule of docs/algorithm.md §3.2, used by the worker
    (``diloco_worker.fragment_state``, which adds the tensors) and by the benchmark harness's
    simulated learners.
    """

    def __init__(
        self,
        plan: FragmentPlan,
        counters: Sequence[FragmentCounter] | None = None,
        schedule: Schedule = "fixed",
    ) -> None:
        if counters is not None and len(counters) != len(plan.fragments):
            raise ValueError(
                f"{len(counters)} fragment counters for a plan of {len(plan.fragments)} fragments"
            )
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r} ({' or '.join(SCHEDULES)})")
        self.plan, self.schedule = plan, schedule
        self._counters = (
            list(counters)
            if counters is not None
            else [FragmentCounter(steps=-f.offset, since_send=-f.offset) for f in plan.fragments]
        )

    def __getitem__(self, p: int) -> FragmentCounter:
        return self._counters[p]

    def __len__(self) -> int:
        return len(self._counters)

    def __iter__(self) -> Iterator[FragmentCounter]:
        return iter(self._counters)

    def advance(self, tokens: int) -> None:
        """One inner step of ``tokens`` tokens was taken."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        for c in self._counters:
            c.steps += 1
            c.since_send += 1
            if c.steps > 0:
                c.tokens += tokens

    def due(self) -> list[int]:
        """The fragments whose outer gradient should be sent now."""
        if self.schedule == "fixed":
            h = self.plan.inner_steps
            return [
                i
                for i, c in enumerate(self._counters)
                if c.since_send > 0 and c.since_send % h == 0 and self.unsent(i)
            ]
        return [
            i
            for i, c in enumerate(self._counters)
            if c.steps > 0 and self.plan.is_due(i, c.steps - c.sent_at)
        ]

    def unsent(self, p: int) -> bool:
        """True when fragment ``p`` has progress since its last send (or since its version, if none)."""
        c = self._counters[p]
        return c.steps > 0 and c.steps > c.sent_at

    def mark_sent(self, p: int) -> Sent:
        """Fragment ``p``'s progress since its previous send (or its version) is being sent."""
        c = self._counters[p]
        sent = Sent(
            base_version=c.base_version,
            since=c.sent_at,
            steps=c.steps - c.sent_at,
            tokens=c.tokens - c.sent_tokens,
            seq=c.seq + 1,
        )
        c.sent_at, c.sent_tokens, c.seq, c.since_send = c.steps, c.tokens, sent.seq, 0
        return sent

    def reset(self, p: int, base_version: int) -> None:
        """Fragment ``p`` took global version ``base_version``: counting starts again from it."""
        c = self._counters[p]
        c.base_version, c.steps, c.tokens, c.sent_at, c.sent_tokens = base_version, 0, 0, 0, 0

    def set_base(self, p: int, base_version: int) -> None:
        """Fragment ``p`` starts from ``base_version`` without touching its counts (first contact)."""
        self._counters[p].base_version = base_version

    def set_steps(self, steps: Mapping[int, int]) -> None:
        """Put fragments at the given steps since their last sync, nothing sent yet (a learner that
        joins a synchronous job takes its place in the round cycle)."""
        for p, n in steps.items():
            c = self._counters[p]
            c.steps, c.tokens, c.sent_at, c.sent_tokens, c.since_send = n, 0, 0, 0, n

    def versions(self) -> dict[int, int]:
        return {i: c.base_version for i, c in enumerate(self._counters)}

    def to_list(self) -> list[dict[str, int]]:
        """One dict per fragment (the learner's checkpoint stores this)."""
        return [c.to_dict() for c in self._counters]

    @classmethod
    def from_list(
        cls, plan: FragmentPlan, meta: Sequence[Mapping[str, Any]], schedule: Schedule = "fixed"
    ) -> FragmentCounters:
        return cls(plan, [FragmentCounter.from_dict(m) for m in meta], schedule)
