"""The learner's side of DiLoCo, per fragment: anchor, base version, counters, and the two moves
of the algorithm (docs/algorithm.md §3.3):

- when a fragment is due:  delta_p = A_p - theta_p   (sent in the background, training goes on);
- when a global version v of Theta_p arrives (at a step boundary):
  theta_p <- alpha * theta_p + (1 - alpha) * Theta_p;  A_p <- Theta_p;  base_version <- v;  counters <- 0.

A fragment that was sent but whose merge has not come back yet falls due again after another H steps,
and the fresher outer gradient (still relative to the same anchor) supersedes the unsent older one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diloco_core.fragments import FragmentPlan
from diloco_core.learner import apply_global, outer_gradient
from torch import nn


@dataclass
class FragmentCounter:
    base_version: int = -1
    steps: int = 0  # inner steps since the last global version (starts at -offset)
    tokens: int = 0
    sent_at: int = 0  # value of ``steps`` at the last send since that version (0: not sent)
    seq: int = 0  # idempotency sequence of contributions

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Contribution:
    """An outer gradient ready to be sent."""

    fragment: int
    base_version: int
    steps: int
    tokens: int
    seq: int
    tensors: dict[str, np.ndarray]


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().float().numpy().copy()


class FragmentState:
    """Anchors and counters of every fragment of one learner (shared by all ranks of a unit)."""

    def __init__(self, plan: FragmentPlan, params: Mapping[str, torch.Tensor]) -> None:
        missing = [n for f in plan.fragments for n in f.names if n not in params]
        if missing:
            raise ValueError(f"the model has no parameters named {missing[:5]} that the fragment plan lists")
        self.plan = plan
        self.params = dict(params)
        self.counters = [FragmentCounter(steps=-f.offset) for f in plan.fragments]
        self.anchors: dict[int, dict[str, np.ndarray]] = {
            f.index: {n: _to_numpy(self.params[n]) for n in f.names} for f in plan.fragments
        }

    @classmethod
    def for_model(cls, plan: FragmentPlan, model: nn.Module) -> FragmentState:
        return cls(plan, dict(model.named_parameters()))

    def fragment_params(self, p: int) -> dict[str, np.ndarray]:
        return {n: _to_numpy(self.params[n]) for n in self.plan.fragments[p].names}

    def advance(self, tokens: int) -> None:
        """One inner step of ``tokens`` tokens was taken."""
        for c in self.counters:
            c.steps += 1
            if c.steps > 0:
                c.tokens += tokens

    def due(self) -> list[int]:
        """Fragments whose outer gradient should be sent now."""
        return [
            i for i, c in enumerate(self.counters) if c.steps > 0 and self.plan.is_due(i, c.steps - c.sent_at)
        ]

    def take_contribution(self, p: int) -> Contribution:
        """delta_p = A_p - theta_p, and mark the fragment as sent."""
        self.mark_sent(p)
        c = self.counters[p]
        delta = outer_gradient(self.anchors[p], self.fragment_params(p))
        return Contribution(p, c.base_version, c.steps, c.tokens, c.seq, delta)

    @torch.no_grad()
    def apply(self, p: int, version: int, global_params: Mapping[str, np.ndarray], alpha: float) -> None:
        """Take global version ``version`` of fragment ``p`` (mixing factor ``alpha``)."""
        mixed = apply_global(self.fragment_params(p), global_params, alpha) if alpha > 0 else global_params
        for name, value in mixed.items():
            target = self.params[name]
            target.copy_(
                torch.from_numpy(np.asarray(value, dtype=np.float32)).to(target.device, target.dtype)
            )
        self.anchors[p] = {n: np.array(v, dtype=np.float32, copy=True) for n, v in global_params.items()}
        c = self.counters[p]
        c.base_version, c.steps, c.tokens, c.sent_at = version, 0, 0, 0

    @torch.no_grad()
    def set_base(self, p: int, version: int, global_params: Mapping[str, np.ndarray]) -> None:
        """Start from global version ``version`` without touching the counters (first contact)."""
        for name, value in global_params.items():
            target = self.params[name]
            target.copy_(
                torch.from_numpy(np.asarray(value, dtype=np.float32)).to(target.device, target.dtype)
            )
        self.anchors[p] = {n: np.array(v, dtype=np.float32, copy=True) for n, v in global_params.items()}
        self.counters[p].base_version = version

    def mark_sent(self, p: int) -> None:
        """What :meth:`take_contribution` does to the counters, for ranks that do not send."""
        c = self.counters[p]
        c.sent_at, c.seq = c.steps, c.seq + 1

    def set_counters(self, steps: Mapping[int, int]) -> None:
        """Put fragments at the given steps since their last sync, nothing sent yet (a learner that
        joins a synchronous job takes its place in the round cycle: :mod:`.lockstep`)."""
        for p, n in steps.items():
            c = self.counters[p]
            c.steps, c.tokens, c.sent_at = n, 0, 0

    def versions(self) -> dict[int, int]:
        return {i: c.base_version for i, c in enumerate(self.counters)}

    def meta(self) -> list[dict[str, Any]]:
        return [c.to_dict() for c in self.counters]

    def load_meta(self, meta: list[dict[str, Any]], anchors: Mapping[int, Mapping[str, np.ndarray]]) -> None:
        if len(meta) != len(self.counters):
            raise ValueError(f"checkpoint has {len(meta)} fragments, the plan has {len(self.counters)}")
        self.counters = [FragmentCounter(**{k: int(v) for k, v in m.items()}) for m in meta]
        for p, tensors in anchors.items():
            self.anchors[p] = {n: np.array(v, dtype=np.float32) for n, v in tensors.items()}
