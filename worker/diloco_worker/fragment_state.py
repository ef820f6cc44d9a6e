"""The learner's side of DiLoCo, per fragment: anchor, base version, counters, and the two moves
of the algorithm (docs/algorithm.md §3.3):

- when a fragment is due:  delta_p = A_p - theta_p   (sent in the background, training goes on),
  then A_p <- theta_p: a later send before the next global version carries only the progress after
  this one (``since``), so no progress is sent, or merged, twice;
- when a global version v of Theta_p arrives (at a step boundary):
  theta_p <- alpha * theta_p + (1 - alpha) * Theta_p;  A_p <- Theta_p;  base_version <- v;  counters <- 0.

When a fragment is due, and the rest of the counting, is ``diloco_core.learner.FragmentCounters``
(docs/algorithm.md §3.2); this module bridges it to the tensors.

The tensors (anchors, ``anchor - params``, taking a global version) live in an
:class:`~.anchor_store.AnchorStore`: numpy on the host, or torch on the learner's device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from diloco_core import feedback
from diloco_core.codec import encode
from diloco_core.config import Schedule
from diloco_core.fragments import FragmentPlan
from diloco_core.learner import FragmentCounters, outer_gradient
from torch import nn

from .anchor_store import AnchorStore, OuterDelta
from .anchors import HostAnchors


@dataclass(frozen=True)
class FeedbackPayload:
    """An outer gradient encoded with error feedback by the feedback thread (in the order the
    fragments fell due: each residual depends on the previous payload); ``encode`` waits for it."""

    future: Future[feedback.Encoded]

    def encode(self, *, fragment: int, base_version: int, quantizer: str) -> bytes:
        return self.future.result().encode(fragment=fragment, base_version=base_version, quantizer=quantizer)


@dataclass(frozen=True)
class StoredPayload:
    """An outer gradient encoded already: a checkpoint's copy of one the synchronizer had not durably
    taken when the checkpoint was written, sent again as it was."""

    blob: bytes
    quantizer: str

    def encode(self, *, fragment: int, base_version: int, quantizer: str) -> bytes:
        if quantizer != self.quantizer:
            raise ValueError(
                f"payload of fragment {fragment} v{base_version} is {self.quantizer}, not {quantizer}"
            )
        return self.blob


@dataclass(frozen=True)
class Outgoing:
    """An outer gradient ready to be sent."""

    fragment: int
    base_version: int
    steps: int
    tokens: int
    seq: int
    tensors: Mapping[str, np.ndarray] | OuterDelta  # float32 arrays, or already quantized (torch path)
    since: int = 0  # the step of the previous send on this base version (0: none): progress after it

    def encode(self, quantizer: str) -> bytes:
        """The payload of this outer gradient (compression, and on the torch path the wait for its
        copy to the host: the sender thread's work)."""
        if isinstance(self.tensors, Mapping):
            return encode(
                self.tensors,
                fragment=self.fragment,
                base_version=self.base_version,
                kind="outer_grad",
                quantizer=quantizer,
            )
        return self.tensors.encode(
            fragment=self.fragment, base_version=self.base_version, quantizer=quantizer
        )


class FragmentState:
    """Anchors and counters of every fragment of one learner (shared by all ranks of a unit)."""

    def __init__(
        self,
        plan: FragmentPlan,
        params: Mapping[str, torch.Tensor],
        store: Callable[[FragmentPlan, Mapping[str, torch.Tensor]], AnchorStore] = HostAnchors,
    ) -> None:
        """``store`` builds the anchor store from the plan and the parameters (default: numpy)."""
        missing = [n for f in plan.fragments for n in f.names if n not in params]
        if missing:
            raise ValueError(f"the model has no parameters named {missing[:5]} that the fragment plan lists")
        self.plan = plan
        self.params = dict(params)
        self.counters = FragmentCounters(plan)  # the papers' schedule until the job says otherwise
        self.store = store(plan, self.params)
        self._feedback: ThreadPoolExecutor | None = None  # numpy error feedback, off the training thread

    @classmethod
    def for_model(
        cls,
        plan: FragmentPlan,
        model: nn.Module,
        store: Callable[[FragmentPlan, Mapping[str, torch.Tensor]], AnchorStore] = HostAnchors,
    ) -> FragmentState:
        return cls(plan, dict(model.named_parameters()), store)

    @property
    def residuals(self) -> dict[int, dict[str, np.ndarray]]:
        """Error feedback: per fragment, what its last payload did not carry (docs/algorithm.md
        §3.9), as float32 host arrays; only fragments that have sent one with error feedback. Waits
        for the payloads already due to be encoded."""
        self._feedback_done()
        found = {f.index: self.store.residual(f.index) for f in self.plan.fragments}
        return {p: r for p, r in found.items() if r is not None}

    @property
    def anchors(self) -> dict[int, dict[str, np.ndarray]]:
        """Every fragment's anchor as float32 host arrays."""
        return {f.index: self.store.arrays(f.index) for f in self.plan.fragments}

    def advance(self, tokens: int) -> None:
        """One inner step of ``tokens`` tokens was taken."""
        self.counters.advance(tokens)

    def due(self) -> list[int]:
        """Fragments whose outer gradient should be sent now."""
        return self.counters.due()

    def take_contribution(self, p: int, codec: str = "int4", error_feedback: bool = False) -> Outgoing:
        """delta_p = A_p - theta_p (for a payload in ``codec``); the fragment is marked as sent and
        its anchor moves to the sent point.

        With ``error_feedback`` the payload is ``delta_p`` plus the fragment's residual, and the
        residual becomes what the payload leaves out (``diloco_core.feedback``): on the device path
        queued with the quantization; otherwise the calling thread copies the parameters and one
        feedback thread encodes the payloads in the order they fell due (the next residual depends on
        each). Either way the training thread does not wait for the encoding."""
        c = self.counters.mark_sent(p)
        if not error_feedback or self.store.feeds_back(codec):
            delta = self.store.outer_gradient(p, codec, error_feedback)
            self.store.advance_anchor(p)
            return Outgoing(p, c.base_version, c.steps, c.tokens, c.seq, delta, since=c.since)
        params = {
            n: self.params[n].detach().float().cpu().numpy().copy() for n in self.plan.fragments[p].names
        }
        anchor = self.store.arrays(p)  # replaced, never written in place, by the anchor's next move
        if self._feedback is None:
            self._feedback = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"feedback-{id(self):x}")
        job = self._feedback.submit(self._encode_with_feedback, p, anchor, params, c.base_version, codec)
        self.store.advance_anchor(p)
        return Outgoing(p, c.base_version, c.steps, c.tokens, c.seq, FeedbackPayload(job), since=c.since)

    def _feedback_done(self) -> None:
        """Wait until the payloads already due are encoded (one thread, in order: a no-op queued
        behind them)."""
        if self._feedback is not None:
            self._feedback.submit(lambda: None).result()

    def _encode_with_feedback(
        self,
        p: int,
        anchor: Mapping[str, np.ndarray],
        params: Mapping[str, np.ndarray],
        base: int,
        quantizer: str,
    ) -> feedback.Encoded:
        """On the feedback thread: the payload of ``anchor - params`` plus the residual, and the new
        residual (computed in the outer gradient's own arrays). Only the bytes wait for the sender:
        neither what they decode to nor the residual (the store keeps its own copy) stays with them."""
        enc = feedback.encode(
            outer_gradient(anchor, params),
            self.store.residual(p),
            fragment=p,
            base_version=base,
            kind="outer_grad",
            quantizer=quantizer,
            owned=True,
        )
        self.store.set_residual(p, enc.residual)
        return replace(enc, decoded={}, residual={})

    def apply(self, p: int, version: int, global_params: Mapping[str, np.ndarray], alpha: float) -> None:
        """Take global version ``version`` of fragment ``p`` (mixing factor ``alpha``)."""
        self.store.apply(p, global_params, alpha)
        self.counters.reset(p, version)

    def set_base(self, p: int, version: int, global_params: Mapping[str, np.ndarray]) -> None:
        """Start from global version ``version`` without touching the counters (first contact)."""
        self.store.apply(p, global_params, 0.0)
        self.counters.set_base(p, version)

    def mark_sent(self, p: int) -> None:
        """What :meth:`take_contribution` does to the counters and the anchor, for ranks that do not send."""
        self.counters.mark_sent(p)
        self.store.advance_anchor(p)

    def set_counters(self, steps: Mapping[int, int]) -> None:
        """Put fragments at the given steps since their last sync, nothing sent yet (a learner that
        joins a synchronous job takes its place in the round cycle: :mod:`.lockstep`)."""
        self.counters.set_steps(steps)

    def set_schedule(self, schedule: Schedule) -> None:
        """When fragments fall due (the job's ``schedule``, docs/algorithm.md §3.2)."""
        self.counters.schedule = schedule

    def versions(self) -> dict[int, int]:
        return self.counters.versions()

    def meta(self) -> list[dict[str, Any]]:
        return self.counters.to_list()

    def load_meta(
        self,
        meta: list[dict[str, Any]],
        anchors: Mapping[int, Mapping[str, np.ndarray]],
        residuals: Mapping[int, Mapping[str, np.ndarray]] | None = None,
    ) -> None:
        """Counters, anchors and (error feedback) residuals from a checkpoint."""
        if len(meta) != len(self.counters):
            raise ValueError(f"checkpoint has {len(meta)} fragments, the plan has {len(self.counters)}")
        self.counters = FragmentCounters.from_list(self.plan, meta, self.counters.schedule)
        for p, tensors in anchors.items():
            self.store.load(p, tensors)
        self._feedback_done()
        for p, r in (residuals or {}).items():
            self.store.set_residual(p, r)
