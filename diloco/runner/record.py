"""Everything a run records, as plain data: the input of the report (and its JSON form)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from diloco.runner.timeline import Timeline


@dataclass
class KillRecord:
    """One chaos kill: when the learner died, when its process was started again, and when it was
    seen training again (rejoined), or killed again before it rejoined."""

    learner: int
    at_s: float
    step: int
    restarted_at_s: float | None = None
    rejoined_at_s: float | None = None
    killed_again_at_s: float | None = None


@dataclass(frozen=True)
class LossSample:
    """Held-out loss of the global model at ``wall_s`` seconds, after ``tokens`` tokens in all."""

    wall_s: float
    tokens: int
    loss: float


@dataclass
class LearnerTotals:
    learner: int
    learner_id: str
    speed_factor: float
    bandwidth_limit: float | None
    steps: int = 0
    tokens: int = 0
    launches: int = 0
    finished: bool = False
    bytes_sent: int = 0
    allreduce_bytes: int = 0  # ddp: what the rank's ring all-reduce sent, and received
    tokens_per_s: float | None = None  # median of its logged steps
    mfu: float | None = None  # median model FLOPs utilisation, where its device's peak is known
    gpu: int | None = None


@dataclass
class RunRecord:
    run_dir: str
    mode: str
    settings: dict[str, Any]
    started_at: float
    duration_s: float = 0.0
    stop_reason: str = ""
    num_params: int = 0
    tokens_per_step: int = 1
    # a run continued with --resume: each learner's step at the resume (its steps, tokens and bytes
    # count from there); empty for a run from the start
    resumed_from: dict[str, int] = field(default_factory=dict)
    resumed: bool = False
    learners: list[LearnerTotals] = field(default_factory=list)
    kills: list[KillRecord] = field(default_factory=list)
    losses: list[LossSample] = field(default_factory=list)
    timeline: Timeline = field(default_factory=Timeline)
    sent_bytes: int = 0
    received_bytes: int = 0
    # at the socket, the learners' connections each way: the synchronizer's count of every connection
    # less the runner's own (its status polls and the evaluator's downloads)
    wire_sent_bytes: int = 0
    wire_received_bytes: int = 0
    rounds: int = 0
    versions: dict[int, int] = field(default_factory=dict)

    @property
    def total_learner_steps(self) -> int:
        return sum(learner.steps for learner in self.learners)

    @property
    def allreduce_bytes(self) -> int:
        """ddp: what the ranks' gradient all-reduce moved each way (0 in the other modes)."""
        return sum(learner.allreduce_bytes for learner in self.learners)

    @property
    def total_tokens(self) -> int:
        return sum(learner.tokens for learner in self.learners)

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in vars(self).items() if k not in ("timeline", "learners", "kills", "losses")}
        data["learners"] = [asdict(x) for x in self.learners]
        data["kills"] = [asdict(x) for x in self.kills]
        data["losses"] = [asdict(x) for x in self.losses]
        data["timeline"] = self.timeline.to_dict()
        data["versions"] = {str(k): v for k, v in self.versions.items()}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunRecord:
        plain = {
            k: v for k, v in data.items() if k not in ("timeline", "learners", "kills", "losses", "versions")
        }
        record = cls(**plain)
        record.learners = [LearnerTotals(**x) for x in data["learners"]]
        record.kills = [KillRecord(**x) for x in data["kills"]]
        record.losses = [LossSample(**x) for x in data["losses"]]
        record.timeline = Timeline.from_dict(data["timeline"])
        record.versions = {int(k): int(v) for k, v in data["versions"].items()}
        return record
