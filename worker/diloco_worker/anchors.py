"""The tensor half of a learner's fragment state: each fragment's anchor, its outer gradient
``anchor - params``, and taking a global version into the parameters (docs/algorithm.md §3.3).

Two implementations of one interface (:class:`.anchor_store.AnchorStore`):

- :class:`HostAnchors` (numpy, the reference): anchors are float32 arrays in host memory; at a due
  step the training thread copies the fragment's parameters to the host and subtracts, and the
  sender thread quantizes and compresses. On a CPU this costs the training thread almost nothing.
- :class:`.device_anchors.DeviceAnchors` (torch): anchors are flat float32 buffers on the learner's
  device, or in pinned host memory when they do not fit there. At a due step the training thread
  only queues work on a side CUDA stream (copy, subtract, quantize byte-identically to the
  reference, copy to pinned host buffers); a global version is copied to the device by the poller
  thread, so that the training thread only copies it into the parameters, device to device.

With error feedback (docs/algorithm.md §3.9) ``DeviceAnchors`` keeps each fragment's residual next
to its anchor and updates it on its side stream. For the formats without a torch quantizer, and in
``HostAnchors``, the caller (``FragmentState``) encodes with the residual in numpy, on a feedback
thread of its own, in the order the fragments fell due.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import numpy as np
import torch
from diloco_core.fragments import FragmentPlan
from diloco_core.learner import apply_global, outer_gradient
from torch import Tensor

from .anchor_store import AnchorStore, Arrays
from .device_anchors import DeviceAnchors, Placement

Compute = Literal["auto", "numpy", "torch"]


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().float().numpy().copy()


class HostAnchors:
    """The numpy reference: anchors in host memory, arithmetic in numpy."""

    def __init__(self, plan: FragmentPlan, params: Mapping[str, Tensor]) -> None:
        self.plan, self.params = plan, params
        self.anchors: dict[int, dict[str, np.ndarray]] = {
            f.index: {n: _to_numpy(params[n]) for n in f.names} for f in plan.fragments
        }
        self.residuals: dict[int, dict[str, np.ndarray]] = {}

    def fragment_params(self, p: int) -> dict[str, np.ndarray]:
        return {n: _to_numpy(self.params[n]) for n in self.plan.fragments[p].names}

    def arrays(self, p: int) -> dict[str, np.ndarray]:
        return self.anchors[p]

    def outer_gradient(self, p: int, quantizer: str, error_feedback: bool = False) -> Arrays:
        if error_feedback:
            raise ValueError("the numpy store leaves error feedback to its caller (feeds_back is False)")
        return outer_gradient(self.anchors[p], self.fragment_params(p))

    def feeds_back(self, quantizer: str) -> bool:
        return False

    def residual(self, p: int) -> dict[str, np.ndarray] | None:
        return self.residuals.get(p)

    def set_residual(self, p: int, arrays: Arrays) -> None:
        self.residuals[p] = {n: np.array(v, dtype=np.float32) for n, v in arrays.items()}

    def advance_anchor(self, p: int) -> None:
        self.anchors[p] = self.fragment_params(p)

    @torch.no_grad()
    def apply(self, p: int, values: Arrays, alpha: float) -> None:
        mixed = apply_global(self.fragment_params(p), values, alpha) if alpha > 0 else values
        for name, value in mixed.items():
            target = self.params[name]
            target.copy_(
                torch.from_numpy(np.asarray(value, dtype=np.float32)).to(target.device, target.dtype)
            )
        self.anchors[p] = {n: np.array(v, dtype=np.float32, copy=True) for n, v in values.items()}

    def load(self, p: int, arrays: Arrays) -> None:
        self.anchors[p] = {n: np.array(v, dtype=np.float32) for n, v in arrays.items()}

    def stage(self, p: int, arrays: dict[str, np.ndarray]) -> Arrays:
        return arrays


def build_anchor_store(
    plan: FragmentPlan,
    params: Mapping[str, Tensor],
    device: torch.device,
    *,
    compute: Compute = "auto",
    placement: Placement = "auto",
) -> AnchorStore:
    """``auto``: torch on a CUDA device, the numpy reference elsewhere (on a CPU the reference keeps
    quantization in the sender thread, off the training thread)."""
    use_torch = compute == "torch" or (compute == "auto" and device.type == "cuda")
    if use_torch:
        return DeviceAnchors(plan, params, device, placement)
    return HostAnchors(plan, params)
