"""A new pod template reaches the learner units a few at a time, and stops at the first that fails.

Changing what every unit's pods are made from (the worker image, a setting of every unit) would
otherwise restart every unit at once, and one wrong image tag would take the whole job down. The
operator restarts (deletes the outdated pods of) as many units at once as the quorum can spare:
``max(1, units up - quorum)``, counting the units it is restarting as up, so a job keeps its quorum
wherever it has one to keep; a unit that is not ready goes first, as it loses least (a readiness probe
that fails for a moment is no reason to restart more units at once).
When a unit's pods of the new template fail (their image cannot be pulled, or they crash over and
over), the rollout halts: the units still on their old pods keep them, and the job says why. It goes
on by itself once the template changes again (a corrected image): the failing unit is then outdated
and not ready, so it is restarted first.

Pure: the caller deletes the pods and says so.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from diloco_operator.schema.status import Condition
from diloco_operator.status.conditions import ROLLOUT_HALTED, condition
from diloco_operator.status.pods import PodObserved
from diloco_operator.status.units import UnitObserved


@dataclass(frozen=True)
class RolloutPlan:
    """What to do now: the units to restart, those held back, and why the rollout halted ("")."""

    restart: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    halted: str = ""

    def describe(self, restarting: Collection[str], room: int) -> str:
        """The condition's message while units are still to be restarted."""
        parts = []
        if restarting:
            parts.append(f"restarting units {', '.join(sorted(restarting))}")
        if self.waiting:
            parts.append(
                f"units {', '.join(self.waiting)} wait for their turn ({room} at a time, keeping the quorum)"
            )
        return "; ".join(parts)


def failing_units(pods: Iterable[PodObserved], templates: Mapping[str, str]) -> dict[str, str]:
    """Units whose pods made from the current template cannot run: unit -> why (one pod's image or
    crash loop)."""
    out: dict[str, str] = {}
    for pod in pods:
        if pod.component != "learner" or pod.deleting or pod.template != templates.get(pod.unit):
            continue
        why = pod.image_problem or pod.crash_loop
        if why and pod.unit not in out:
            out[pod.unit] = f"{pod.name}: {why}"
    return out


def _ready(units: Iterable[UnitObserved]) -> set[str]:
    return {u.name for u in units if u.exists and u.ready_replicas >= u.replicas > 0}


def rollout_width(units: Iterable[UnitObserved], restarting: Collection[str], quorum: int) -> int:
    """How many units may be restarting at once: ``max(1, up - quorum)``, where the units up are the
    ready ones and those the operator is restarting."""
    return max(1, len(_ready(units) | set(restarting)) - quorum)


def rollout_room(units: Iterable[UnitObserved], restarting: Collection[str], quorum: int) -> int:
    """How many more units may be restarted now: the width less those restarting."""
    return rollout_width(units, restarting, quorum) - len(restarting)


def plan_rollout(
    outdated: Collection[str],
    units: Iterable[UnitObserved],
    restarting: Collection[str],
    failing: Mapping[str, str],
    quorum: int,
) -> RolloutPlan:
    """Which of the ``outdated`` units to restart now (see the module)."""
    units = list(units)
    ready = _ready(units)
    pending = sorted(u for u in outdated if u not in restarting)
    if failing:
        unit, why = sorted(failing.items())[0]
        halted = (
            f"the new pod template fails in unit {unit} ({why}): units {', '.join(pending) or '(none)'} keep their "
            "pods until the template changes again"
        )
        return RolloutPlan((), tuple(pending), halted)
    first = sorted(pending, key=lambda u: (u in ready, u))  # a unit not ready loses least
    restart = tuple(sorted(first[: max(0, rollout_room(units, restarting, quorum))]))
    return RolloutPlan(restart, tuple(u for u in pending if u not in restart))


def rollout_condition(
    prev: Sequence[Condition],
    plan: RolloutPlan,
    restarting: Collection[str],
    units: Iterable[UnitObserved],
    quorum: int,
    now: datetime,
) -> Condition:
    """``UnitsUpToDate``: every unit's pods are made from its current template, or the rollout under
    way (units restarting and waiting their turn), or why it halted."""
    ctype = "UnitsUpToDate"
    if plan.halted:
        return condition(prev, ctype, False, ROLLOUT_HALTED, plan.halted, now)
    going = {*restarting, *plan.restart}
    if going or plan.waiting:
        width = rollout_width(units, going, quorum)
        return condition(prev, ctype, False, "RollingOut", plan.describe(going, width), now)
    return condition(
        prev, ctype, True, "UpToDate", "every unit's pods are made from its current pod template", now
    )
