"""The learner registry: who is registered, what they last reported, and who counts as alive."""

from __future__ import annotations

from dataclasses import dataclass, field

from diloco_core.bounds import MAX_STEP_TIME_S
from diloco_core.layout import LearnerRecord, LearnerRegistryRecord
from diloco_core.protocol import Heartbeat, LearnerState, LearnerStatus

STEP_TIME_EMA = 0.3  # weight of the newest reported step time

_COUNTED_STATES: frozenset[LearnerState] = frozenset({"training", "rejoining"})


def plausible_step_time(reported: float, steps: int, elapsed: float) -> float:
    """A reported step time held to the pace the learner's own heartbeats show: a learner that
    advanced ``steps`` steps in ``elapsed`` seconds took at most ``elapsed / steps`` per step, so a
    longer report (one that would stretch every round's grace window) counts as that."""
    if steps <= 0 or elapsed <= 0:
        return reported
    return min(reported, elapsed / steps)


def step_time_ema(previous: float, reported: float, weight: float = STEP_TIME_EMA) -> float:
    """The step time the grace window uses: an EMA of the reported ones. Reports of 0 (not measured
    yet) are ignored, and so are non-finite ones and ones beyond ``MAX_STEP_TIME_S`` (which the API
    refuses already), so the EMA stays within the bound whatever it is given."""
    if not 0 < reported <= MAX_STEP_TIME_S:  # NaN fails every comparison
        return previous
    return reported if previous <= 0 else (1 - weight) * previous + weight * reported


class UnknownLearner(KeyError):
    """A call about a learner that is not in the registry (never registered, or forgotten)."""


class LearnerLeft(Exception):
    """A heartbeat from a learner that left: it rejoins by registering again, not by heartbeating."""


def token_increment(counted: int | None, reported: int) -> int:
    """Tokens to add to a learner's token counter for a heartbeat reporting ``reported`` in total.

    ``counted`` is the total already counted, or None when unknown (a learner restored after a restart
    or registering after its own resume): its first report then only sets the baseline, so a restart
    does not count a learner's whole history again. A total that went backwards (a learner resumed
    from an older checkpoint) also only resets the baseline.
    """
    if counted is None or reported < counted:
        return 0
    return reported - counted


@dataclass
class Learner:
    record: LearnerRecord
    last_seen: float
    state: LearnerState = "training"
    step: int = 0
    tokens: int = 0
    tokens_counted: int | None = None
    step_time_s: float = 0.0
    eval_loss: float | None = None
    bytes_sent: int = 0
    bytes_received: int = 0  # global versions served to it since start-up
    wire_sent: int = 0  # as the learner reports its sockets' counts
    wire_received: int = 0
    blocked_s: float = 0.0
    contributions: int = 0
    base_versions: dict[int, int] = field(default_factory=dict)

    @property
    def has_left(self) -> bool:
        """Called leave (now or before a restart) and has not registered since."""
        return self.state == "left"

    def is_alive(self, now: float, timeout_s: float) -> bool:
        """Alive: heard from within the heartbeat timeout and not leaving."""
        return self.state in _COUNTED_STATES and now - self.last_seen <= timeout_s


class LearnerRegistry:
    """In-memory view of the learners; the durable part is ``to_record()`` (ids, units, batch sizes)."""

    def __init__(self, heartbeat_timeout_s: float) -> None:
        self.timeout_s = heartbeat_timeout_s
        self.learners: dict[str, Learner] = {}

    def restore(self, record: LearnerRegistryRecord, now: float) -> None:
        """Reload registered learners after a restart; each that had not left gets one heartbeat
        timeout to show up, and one that had left stays left."""
        for learner_id, rec in record.learners.items():
            self.learners[learner_id] = Learner(
                record=rec,
                last_seen=now,
                state="left" if rec.left else "training",
                step=rec.step,
                tokens=rec.tokens,
            )

    def to_record(self) -> LearnerRegistryRecord:
        return LearnerRegistryRecord(learners={lid: lr.record for lid, lr in self.learners.items()})

    def register(self, record: LearnerRecord, step: int, now: float) -> bool:
        """Add or refresh a learner; True when the durable record changed."""
        existing = self.learners.get(record.learner_id)
        if existing is None:
            counted = 0 if step == 0 else None
            self.learners[record.learner_id] = Learner(
                record=record, last_seen=now, step=step, tokens_counted=counted
            )
            return True
        changed = (existing.record.unit, existing.record.tokens_per_step, existing.record.left) != (
            record.unit,
            record.tokens_per_step,
            False,
        )
        if changed:
            existing.record = record.model_copy(
                update={"registered_at": existing.record.registered_at, "left": False}
            )
        existing.last_seen, existing.state, existing.step = now, "training", max(existing.step, step)
        return changed

    def get(self, learner_id: str) -> Learner | None:
        return self.learners.get(learner_id)

    def heartbeat(self, learner_id: str, hb: Heartbeat, now: float) -> int:
        """Record a heartbeat; returns the tokens trained since the last one counted.

        Raises ``UnknownLearner`` for a learner that is not registered, ``LearnerLeft`` for one that left.
        """
        learner = self.learners.get(learner_id)
        if learner is None:
            raise UnknownLearner(learner_id)
        if learner.has_left:
            raise LearnerLeft(learner_id)
        increment = token_increment(learner.tokens_counted, hb.tokens)
        learner.tokens_counted = hb.tokens
        reported = plausible_step_time(hb.step_time_s, hb.step - learner.step, now - learner.last_seen)
        learner.last_seen = now
        learner.state = hb.state
        learner.step, learner.tokens = hb.step, hb.tokens
        learner.step_time_s = step_time_ema(learner.step_time_s, reported)
        learner.bytes_sent, learner.blocked_s = hb.bytes_sent, hb.blocked_s
        learner.wire_sent, learner.wire_received = hb.wire_sent, hb.wire_received
        if hb.eval_loss is not None:
            learner.eval_loss = hb.eval_loss
        return increment

    def leave(self, learner_id: str, now: float) -> bool:
        """Mark a learner left and record its final step and tokens; True when the durable record
        changed (it had not left before, or left again further on)."""
        learner = self.learners.get(learner_id)
        if learner is None:
            raise UnknownLearner(learner_id)
        learner.state, learner.last_seen = "left", now
        final = {"left": True, "step": learner.step, "tokens": learner.tokens}
        if all(getattr(learner.record, key) == value for key, value in final.items()):
            return False
        learner.record = learner.record.model_copy(update=final)
        return True

    def alive_count(self, now: float) -> int:
        return sum(1 for lr in self.learners.values() if lr.is_alive(now, self.timeout_s))

    def step_time(self, now: float) -> float:
        """The lower median step time of the alive learners that reported one (0.0 when none did):
        one learner of two, or any minority, cannot stretch the grace window by reporting long steps."""
        times = sorted(
            lr.step_time_s
            for lr in self.learners.values()
            if lr.is_alive(now, self.timeout_s) and lr.step_time_s > 0
        )
        return times[(len(times) - 1) // 2] if times else 0.0

    def status(self, now: float, versions: dict[int, int]) -> list[LearnerStatus]:
        out = []
        for lid, lr in sorted(self.learners.items()):
            alive = lr.is_alive(now, self.timeout_s)
            stale = [versions[p] - v for p, v in lr.base_versions.items() if versions.get(p, -1) >= 0]
            state: LearnerState = lr.state if alive or lr.state in ("left", "leaving") else "dead"
            out.append(
                LearnerStatus(
                    learner_id=lid,
                    unit=lr.record.unit,
                    state=state,
                    alive=alive,
                    step=lr.step,
                    tokens=lr.tokens,
                    step_time_s=lr.step_time_s,
                    staleness=max(stale, default=0),
                    last_seen_s=max(0.0, now - lr.last_seen),
                    eval_loss=lr.eval_loss,
                    contributions=lr.contributions,
                    bytes_sent=lr.bytes_sent,
                    bytes_received=lr.bytes_received,
                    wire_sent=lr.wire_sent,
                    wire_received=lr.wire_received,
                    blocked_s=lr.blocked_s,
                )
            )
        return out

    def goodput(self) -> float | None:
        """Share of learner time spent computing rather than blocked on communication."""
        compute = sum(lr.step * lr.step_time_s for lr in self.learners.values())
        blocked = sum(lr.blocked_s for lr in self.learners.values())
        return compute / (compute + blocked) if compute + blocked > 0 else None
