"""Learner-side DiLoCo state as pure functions on numpy arrays (docs/algorithm.md §3.3).

Per fragment a learner keeps an anchor (the last global version it received), a step counter that
starts at ``-offset`` so fragments fall due at different steps, the tokens seen since the fragment's
last sync, and the base version its outer gradient is relative to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from diloco_core.fragments import FragmentPlan

F32 = npt.NDArray[np.float32]


def outer_gradient(
    anchor: Mapping[str, npt.NDArray[np.floating]], params: Mapping[str, npt.NDArray[np.floating]]
) -> dict[str, F32]:
    """``anchor - params`` per tensor (the sign the outer optimizer expects)."""
    if set(anchor) != set(params):
        raise ValueError(f"anchor and params name different tensors: {sorted(set(anchor) ^ set(params))}")
    out = {}
    for name in anchor:
        a, p = np.asarray(anchor[name], np.float32), np.asarray(params[name], np.float32)
        if a.shape != p.shape:
            raise ValueError(f"tensor {name!r}: anchor {a.shape} vs params {p.shape}")
        out[name] = a - p
    return out


def apply_global(
    params: Mapping[str, npt.NDArray[np.floating]],
    global_params: Mapping[str, npt.NDArray[np.floating]],
    alpha: float,
) -> dict[str, F32]:
    """``alpha * params + (1 - alpha) * global``; alpha = 0 overwrites the local values (the default)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if set(params) != set(global_params):
        raise ValueError(
            f"params and global name different tensors: {sorted(set(params) ^ set(global_params))}"
        )
    out = {}
    for name, g in global_params.items():
        g32 = np.asarray(g, np.float32)
        if g32.shape != np.shape(params[name]):
            raise ValueError(f"tensor {name!r}: params {np.shape(params[name])} vs global {g32.shape}")
        out[name] = (
            g32.copy()
            if alpha == 0.0
            else np.float32(alpha) * np.asarray(params[name], np.float32) + np.float32(1.0 - alpha) * g32
        )
    return out


@dataclass(frozen=True)
class FragmentCounters:
    """Per-fragment steps, tokens since the last sync, and base version. Immutable: helpers return new values.

    Tokens are counted only for steps after the counter passed zero, so ``tokens / steps`` is the
    learner's tokens per step on the first round too.

    This is the counting rule of docs/algorithm.md §3.2 in its plainest form, a reference for code that
    simulates learners without PyTorch: the core's tests drive whole rounds with it (a learner that
    sends when due and resets when the merge comes back). A fragment is due from its H-th step after
    the last global version until :meth:`reset`, whether or not its outer gradient was sent.

    The worker does not use it: ``diloco_worker.fragment_state.FragmentCounter`` is a mutable
    counter per fragment with the same start (``-offset``), token rule and reset, plus what a
    learner that overlaps communication with training needs: ``sent_at`` (a fragment sent and not
    yet merged falls due again H steps after that send, not at every step) and ``seq`` (the
    contribution's idempotency sequence), and its own checkpoint layout (one dict per fragment).
    """

    steps: tuple[int, ...]
    tokens: tuple[int, ...]
    base_version: tuple[int, ...]

    @classmethod
    def start(cls, plan: FragmentPlan, base_versions: Mapping[int, int] | None = None) -> FragmentCounters:
        """Counters at ``-offset`` per fragment; base versions from the synchronizer (default -1: none)."""
        n = len(plan.fragments)
        versions = base_versions or {}
        return cls(
            tuple(-f.offset for f in plan.fragments), (0,) * n, tuple(versions.get(i, -1) for i in range(n))
        )

    def advance(self, tokens: int) -> FragmentCounters:
        """After one inner step that consumed ``tokens`` tokens."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        steps = tuple(s + 1 for s in self.steps)
        toks = tuple(t + tokens if s > 0 else t for s, t in zip(steps, self.tokens, strict=True))
        return replace(self, steps=steps, tokens=toks)

    def reset(self, index: int, base_version: int) -> FragmentCounters:
        """After fragment ``index`` received global version ``base_version``: counting starts again."""
        return replace(
            self,
            steps=_set(self.steps, index, 0),
            tokens=_set(self.tokens, index, 0),
            base_version=_set(self.base_version, index, base_version),
        )

    def due(self, plan: FragmentPlan) -> list[int]:
        """The fragments whose H inner steps are done."""
        return [i for i, s in enumerate(self.steps) if plan.is_due(i, s)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": list(self.steps),
            "tokens": list(self.tokens),
            "base_version": list(self.base_version),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FragmentCounters:
        try:
            steps, tokens, versions = (
                tuple(int(x) for x in d[k]) for k in ("steps", "tokens", "base_version")
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed fragment counters: {exc!r}") from exc
        if not len(steps) == len(tokens) == len(versions):
            raise ValueError("malformed fragment counters: lists of different lengths")
        return cls(steps, tokens, versions)


def _set(values: tuple[int, ...], index: int, value: int) -> tuple[int, ...]:
    if not 0 <= index < len(values):
        raise IndexError(f"fragment {index} out of range ({len(values)} fragments)")
    return (*values[:index], value, *values[index + 1 :])
