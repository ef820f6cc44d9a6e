"""Typed model of a DiLoCoJob's status, matching the CRD's ``status`` schema (camelCase on the wire).

The operator writes the status with a JSON merge patch: a field that is not in the patch keeps its
stored value, a field set to null is removed. The models keep that difference as pydantic's "unset"
versus None: builders set exactly the fields they mean to write, and :meth:`JobStatus.to_patch`
leaves the unset ones out.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

log = logging.getLogger(__name__)

Phase = Literal["Pending", "Running", "Degraded", "Suspended", "Succeeded", "Failed"]
ACTIVE_PHASES = ("Running", "Degraded")
# phases in which the operator scales the learner units down on purpose: units down are no loss
STOPPED_PHASES = ("Succeeded", "Suspended")


def iso(t: datetime) -> str:
    """A time as the status writes it (UTC, whole seconds)."""
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_iso(s: str) -> datetime:
    return datetime.fromisoformat(s.replace("Z", "+00:00"))


ConditionStatus = Literal["True", "False", "Unknown"]
UnitState = Literal["Ready", "NotReady", "Lost"]
ExportState = Literal["Pending", "Running", "Succeeded", "Failed"]
UnitReason = Literal[
    "Ready", "PodsNotReady", "LearnersDead", "Unschedulable", "ImagePullFailed", "Queued", "Preempted"
]


class _Status(BaseModel):
    # a status written by another version of the operator may carry fields this one does not know
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True)


class Condition(_Status):
    """A condition; its lastTransitionTime moves only when its status changes."""

    type: str
    status: ConditionStatus
    reason: str = ""
    message: str = ""
    last_transition_time: str = ""


class UnitStatus(_Status):
    """One learner unit's readiness, and its learners' progress as the synchronizer reports it."""

    name: str
    replicas: int
    ready_replicas: int
    ready: bool
    state: UnitState
    reason: UnitReason
    ever_ready: bool = False
    not_ready_since: str | None = None  # set while not ready
    message: str | None = None  # why, where a reason has more to say (the scheduler's message)
    admission: str | None = None  # under a queue: Admitted, Queued or Preempted (Kueue's workload)
    step: int | None = None
    tokens: int | None = None
    staleness: int | None = None
    alive_learners: int | None = None
    dead_learners: int | None = None


class ChaosStatus(_Status):
    """Built-in chaos bookkeeping: pods killed, units under repair until (epoch seconds; None removes)."""

    kills: int = 0
    down_until: dict[str, float | None] = Field(default_factory=dict)
    last_tick: float | None = None


class ExportStatus(_Status):
    """The model taken out when the job Succeeded (``export``): where, at which versions, its held-out loss."""

    state: ExportState
    location: str
    versions: dict[str, int] | None = None  # per fragment
    rounds: int | None = None
    held_out_loss: float | None = None
    message: str | None = None  # why it failed, or what could not be read


class JobStatus(_Status):
    phase: Phase | None = None
    message: str | None = None
    observed_generation: int | None = None
    units_ready: str | None = None
    ready_units: int | None = None
    total_units: int | None = None
    version: int | None = None
    rounds: int | None = None
    tokens: int | None = None
    goodput: float | None = None
    conditions: tuple[Condition, ...] = ()
    units: tuple[UnitStatus, ...] = ()
    export: ExportStatus | None = None
    chaos: ChaosStatus | None = None

    @classmethod
    def read(cls, stored: Mapping[str, Any]) -> JobStatus:
        """The status as the API stores it; one that does not parse counts as empty (it is rebuilt)."""
        try:
            return cls.model_validate(dict(stored))
        except ValidationError as exc:
            log.warning("ignoring a stored status that does not parse: %s", exc)
            return cls()

    def to_patch(self) -> dict[str, Any]:
        """The merge patch that writes this status: the fields that were set, None ones as null."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)

    def merged(self, patch: Mapping[str, Any]) -> JobStatus:
        """The status the apiserver stores when ``patch`` (a JSON merge patch) is written over this one."""
        return JobStatus.read(
            merge_patch(self.model_dump(mode="json", by_alias=True, exclude_none=True), patch)
        )

    def condition(self, ctype: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == ctype), None)


def merge_patch(doc: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """RFC 7386: ``doc`` with ``patch`` merged in (null removes a key, objects merge, the rest replaces)."""
    out = dict(doc)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping):
            current = out.get(key)
            out[key] = merge_patch(current if isinstance(current, Mapping) else {}, value)
        else:
            out[key] = value
    return out
