"""Bytes on the wire, measured vs what data-parallel training of the same tokens would send (pure).

Data-parallel baseline: every learner step all-reduces the full fp32 gradient. A ring all-reduce is a
reduce-scatter followed by an all-gather; in each half every rank sends ``(n-1)/n`` of the buffer, so
a rank sends ``2 (n-1)/n · 4 · params`` bytes per step, which we round up to ``2 · 4 · params``
(the large-``n`` limit). Summed over learners, the bytes data-parallel would have *sent* are::

    dp_bytes = params x 4 bytes x 2 x total_learner_steps

where ``total_learner_steps`` counts every inner step of every learner (one step = one batch, so the
same tokens). The measured side counts what the learners sent to the synchronizer (outer gradients,
after quantisation and compression); what they received is reported next to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FP32_BYTES = 4
RING_ALLREDUCE_FACTOR = 2


def data_parallel_bytes(num_params: int, total_learner_steps: int) -> int:
    if num_params < 0 or total_learner_steps < 0:
        raise ValueError("parameter count and steps must be >= 0")
    return num_params * FP32_BYTES * RING_ALLREDUCE_FACTOR * total_learner_steps


@dataclass(frozen=True)
class Traffic:
    num_params: int
    total_learner_steps: int
    sent_bytes: int
    received_bytes: int

    @property
    def data_parallel_bytes(self) -> int:
        return data_parallel_bytes(self.num_params, self.total_learner_steps)

    @property
    def reduction(self) -> float | None:
        """How many times fewer bytes were sent than data-parallel would have sent."""
        return self.data_parallel_bytes / self.sent_bytes if self.sent_bytes > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return vars(self) | {"data_parallel_bytes": self.data_parallel_bytes, "reduction": self.reduction}


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
