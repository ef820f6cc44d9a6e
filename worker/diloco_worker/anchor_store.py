"""What a learner's fragment state asks of the store that keeps its tensors: each fragment's
anchor, its outer gradient ``anchor - params``, its error-feedback residual, and taking a global
version into the parameters (docs/algorithm.md §3.3). :mod:`.anchors` holds the numpy reference and
the choice between it and the torch store of :mod:`.device_anchors`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import numpy as np

Arrays = Mapping[str, np.ndarray]


class OuterDelta(Protocol):
    """An outer gradient prepared for the wire (the torch path quantizes it before the sender)."""

    def encode(self, *, fragment: int, base_version: int, quantizer: str) -> bytes: ...


class AnchorStore(Protocol):
    def arrays(self, p: int) -> dict[str, np.ndarray]:
        """Fragment ``p``'s anchor as float32 host arrays (checkpoints, the initial upload)."""
        ...

    def outer_gradient(self, p: int, quantizer: str, error_feedback: bool = False) -> Arrays | OuterDelta:
        """``anchor - params`` of fragment ``p`` for a payload in ``quantizer``; with
        ``error_feedback`` (only where :meth:`feeds_back`) plus the fragment's residual, which
        becomes what the payload leaves out."""
        ...

    def feeds_back(self, quantizer: str) -> bool:
        """Whether :meth:`outer_gradient` keeps error feedback itself for this format (else the
        caller does, with :meth:`residual` and :meth:`set_residual`)."""
        ...

    def residual(self, p: int) -> dict[str, np.ndarray] | None:
        """Fragment ``p``'s error-feedback residual as float32 host arrays (None: none yet)."""
        ...

    def set_residual(self, p: int, arrays: Arrays) -> None: ...

    def advance_anchor(self, p: int) -> None:
        """The anchor of fragment ``p`` becomes its current parameters (its progress was just sent)."""
        ...

    def apply(self, p: int, values: Arrays, alpha: float) -> None:
        """``params <- alpha * params + (1 - alpha) * values; anchor <- values``."""
        ...

    def load(self, p: int, arrays: Arrays) -> None:
        """Set the anchor (from a checkpoint)."""
        ...

    def stage(self, p: int, arrays: dict[str, np.ndarray]) -> Arrays:
        """Prepare a decoded global version for :meth:`apply` (called by the poller threads)."""
        ...
