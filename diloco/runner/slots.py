"""Per-learner bookkeeping of the orchestrator, and the pure rules that read the synchronizer's status."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from diloco_core.protocol import LearnerStatus

from diloco.runner.processes import Child
from diloco.runner.record import KillRecord

# what the view shows: training / starting / rejoining / down / finished / failed
SlotState = str


@dataclass
class LearnerSlot:
    index: int
    learner_id: str
    speed_factor: float
    bandwidth_limit: float | None
    child: Child | None = None
    incarnation: int = -1
    state: SlotState = "starting"
    launched_at_s: float = 0.0
    step: int = 0
    tokens: int = 0
    tokens_per_s: float = 0.0
    staleness: int = 0
    step_time_s: float = 0.0
    crashes: int = 0
    down_until_s: float | None = None  # restart due (the repair time after a failure or a crash)
    pending_kill: KillRecord | None = None
    lost_from_step: int | None = None  # the step it was at when it went down, until it trains again
    launches: list[tuple[int, int, float]] = field(default_factory=list)  # (incarnation, pid, at_s)

    @property
    def up(self) -> bool:
        return self.state in ("starting", "rejoining", "training")


def has_rejoined(slot: LearnerSlot, status: LearnerStatus, now_s: float) -> bool:
    """The current process of ``slot`` is training: the synchronizer heard from it since it was
    launched (``last_seen_s`` younger than the process) and it reports the training state."""
    heard_since_launch = status.last_seen_s < max(0.0, now_s - slot.launched_at_s)
    trained = status.state in ("training", "leaving", "left") and status.step > 0
    return bool(trained and heard_since_launch)


def learner_label(mode: str, index: int, learner_id: str) -> str:
    """How notes and the report name a learner process: in ddp mode the learners are the ranks of
    one unit (which rank 0's id names), elsewhere each has its own id."""
    return f"rank {index} of {learner_id}" if mode == "ddp" else f"{learner_id} (learner {index})"


_LAUNCH = "\n=== "  # what processes.launch writes before each start of a process into its log
_RESUMED = re.compile(r"step=(\d+) resumed from checkpoint")


def resumed_step(log_text: str) -> int | None:
    """The step the newest process in a learner's log started from: its checkpoint's step, 0 when it
    started without one, None when the log shows no launch yet."""
    start = log_text.rfind(_LAUNCH)
    if start < 0:
        return None
    found = _RESUMED.findall(log_text[start:])
    return int(found[0]) if found else 0
