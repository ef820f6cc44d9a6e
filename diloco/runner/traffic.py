"""Bytes on the wire each way, against what data-parallel training of the same tokens would move (pure).

Data-parallel baseline: every learner step all-reduces the full gradient in bf16. A ring all-reduce
is a reduce-scatter followed by an all-gather; in each half every rank sends, and receives,
``(n-1)/n`` of the buffer, so a rank sends ``2 (n-1)/n · 2 · params`` bytes per step and receives as
many, which we round up to ``2 · 2 · params`` (the large-``n`` limit). Summed over learners, each
direction::

    data_parallel_bytes = params x 2 bytes (bf16) x 2 x total_learner_steps

where ``total_learner_steps`` counts every inner step of every learner (one step = one batch, so the
same tokens). The measured side, each way: **at the socket**, every byte the learners' connections
to the synchronizer carried (request and response heads, bodies, heartbeats, long-polls, the first
whole-version downloads and initial uploads, TLS where on; ``diloco_core.wire``), and the
**payload**, the codec bytes of the outer gradients sent and of the versions received.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BF16_BYTES = 2
RING_ALLREDUCE_FACTOR = 2


def data_parallel_bytes(num_params: int, total_learner_steps: int) -> int:
    """Bytes data-parallel bf16 training of the same steps moves each way, over all learners."""
    if num_params < 0 or total_learner_steps < 0:
        raise ValueError("parameter count and steps must be >= 0")
    return num_params * BF16_BYTES * RING_ALLREDUCE_FACTOR * total_learner_steps


def _ratio(baseline: int, measured: int) -> float | None:
    return baseline / measured if measured > 0 else None


@dataclass(frozen=True)
class Traffic:
    num_params: int
    total_learner_steps: int
    sent_bytes: int  # payload, learners to synchronizer
    received_bytes: int  # payload, synchronizer to learners
    wire_sent: int = 0  # at the socket, learners to synchronizer
    wire_received: int = 0  # at the socket, synchronizer to learners

    @property
    def data_parallel_bytes(self) -> int:
        return data_parallel_bytes(self.num_params, self.total_learner_steps)

    @property
    def reduction_up(self) -> float | None:
        """How many times fewer bytes the learners sent, at the socket, than data-parallel bf16."""
        return _ratio(self.data_parallel_bytes, self.wire_sent)

    @property
    def reduction_down(self) -> float | None:
        """The same for what they received."""
        return _ratio(self.data_parallel_bytes, self.wire_received)

    @property
    def payload_reduction_up(self) -> float | None:
        return _ratio(self.data_parallel_bytes, self.sent_bytes)

    @property
    def payload_reduction_down(self) -> float | None:
        return _ratio(self.data_parallel_bytes, self.received_bytes)

    def to_dict(self) -> dict[str, Any]:
        return vars(self) | {
            "data_parallel_bytes": self.data_parallel_bytes,
            "reduction_up": self.reduction_up,
            "reduction_down": self.reduction_down,
            "payload_reduction_up": self.payload_reduction_up,
            "payload_reduction_down": self.payload_reduction_down,
        }


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
