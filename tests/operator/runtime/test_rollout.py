"""A new pod template reaches the units a few at a time and halts at the first unit whose pods fail."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from diloco_operator.runtime.pods import (
    Restart,
    outdated_pods,
    restarting_into,
    restarts_under_way,
    unit_observations,
)
from diloco_operator.runtime.rollout import (
    RolloutPlan,
    failing_units,
    plan_rollout,
    rollout_condition,
    rollout_room,
)
from diloco_operator.schema.spec import parse_spec
from diloco_operator.schema.status import JobStatus
from diloco_operator.status.events import diff_events
from diloco_operator.status.pods import observe_pod
from diloco_operator.status.units import UnitObserved

NOW = datetime(2026, 1, 1, tzinfo=UTC)
UNITS = ("a", "b", "c", "d")


def units(ready: str = "abcd") -> list[UnitObserved]:
    return [UnitObserved(u, 1, 1 if u in ready else 0) for u in UNITS]


@pytest.mark.parametrize(
    ("outdated", "ready", "restarting", "quorum", "restart", "waiting"),
    [
        ("abcd", "abcd", "", 2, "ab", "cd"),  # the quorum can spare two units
        ("cd", "cd", "ab", 2, "", "cd"),  # two are restarting: the others wait
        ("cd", "abcd", "", 2, "cd", ""),  # back: the rest go
        ("abcd", "abcd", "", 4, "a", "bcd"),  # no unit to spare: one at a time
        ("abcd", "abcd", "", 1, "abc", "d"),
        ("abcd", "bcd", "", 2, "a", "bcd"),  # a is not ready: it goes first, and one fewer is spared
        ("abcd", "cd", "", 2, "a", "bcd"),  # however many are not ready, one at a time below the quorum
        ("", "abcd", "", 2, "", ""),
    ],
)
def test_units_restart_as_many_at_once_as_the_quorum_can_spare(
    outdated: str, ready: str, restarting: str, quorum: int, restart: str, waiting: str
) -> None:
    plan = plan_rollout(list(outdated), units(ready), list(restarting), {}, quorum)
    assert plan == RolloutPlan(tuple(restart), tuple(waiting))


def test_a_unit_whose_new_pods_fail_halts_the_rollout() -> None:
    plan = plan_rollout(
        ["c", "d"], units("cd"), ["a"], {"a": "j-a-0: image 'w:typo' (learner): ErrImagePull"}, 2
    )
    assert (plan.restart, plan.waiting) == ((), ("c", "d"))
    assert plan.halted.startswith("the new pod template fails in unit a (j-a-0: image 'w:typo'")
    assert "units c, d keep their pods" in plan.halted


def _pod(name: str, unit: str, template: str, waiting: dict[str, Any] | None = None) -> dict[str, Any]:
    labels = {"diloco.dev/job": "j", "app.kubernetes.io/component": "learner", "diloco.dev/unit": unit}
    status: dict[str, Any] = {"phase": "Pending", "conditions": []}
    if waiting:
        status["containerStatuses"] = [
            {"name": "learner", "image": "w:2", "state": {"waiting": waiting},
             "lastState": {"terminated": {"message": "Traceback ...\nValueError: bad config"}}}
        ]  # fmt: skip
    meta = {
        "name": name,
        "uid": name,
        "labels": labels,
        "annotations": {"diloco.dev/template-hash": template},
    }
    return {"metadata": meta, "status": status}


def test_a_corrected_image_restarts_the_failing_unit_at_once_then_the_others() -> None:
    """Two units, quorum 1: unit a was restarted into a wrong image and cannot pull it, b kept its
    pod. Correcting the image makes a's pods outdated: a restarts now, not when its first restart
    runs out of unitLostAfterSeconds, and b waits for a to be back."""
    spec = parse_spec(
        {
            "images": {"worker": "w", "synchronizer": "s"},
            "storage": {"bucket": "bkt"},
            "diloco": {"quorum": 1},
            "learnerUnits": [{"name": "a"}, {"name": "b"}],
        }
    )
    pods = [
        observe_pod(_pod("j-a-0", "a", "typo", {"reason": "ImagePullBackOff"})),
        observe_pod(
            _pod("j-b-0", "b", "old")
            | {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
        ),
    ]
    restarts = restarts_under_way(spec, pods, {"a": Restart(1000.0, "typo")}, 1010.0)

    def plan(templates: dict[str, str]) -> RolloutPlan:
        return plan_rollout(
            outdated_pods(pods, templates),
            unit_observations(spec, pods),
            restarting_into(restarts, templates),
            failing_units(pods, templates),
            1,
        )

    halted = plan({"a": "typo", "b": "typo"})
    assert (halted.restart, halted.waiting) == ((), ("b",))
    assert halted.halted.startswith("the new pod template fails in unit a")
    fixed = plan({"a": "fixed", "b": "fixed"})
    assert fixed == RolloutPlan(("a",), ("b",))


def test_only_pods_of_the_current_template_that_cannot_run_make_a_unit_failing() -> None:
    pods = [
        observe_pod(_pod("j-a-0", "a", "new", {"reason": "ImagePullBackOff"})),
        observe_pod(_pod("j-b-0", "b", "new", {"reason": "CrashLoopBackOff"})),
        observe_pod(_pod("j-c-0", "c", "old", {"reason": "ImagePullBackOff"})),  # the old template's problem
        observe_pod(_pod("j-d-0", "d", "new", {"reason": "ContainerCreating"})),  # not yet known
    ]
    failing = failing_units(pods, dict.fromkeys(UNITS, "new"))
    assert failing == {
        "a": "j-a-0: image 'w:2' (learner): ImagePullBackOff",
        "b": "j-b-0: learner: CrashLoopBackOff: ValueError: bad config",
    }


def test_the_room_counts_the_units_being_restarted_as_up() -> None:
    assert rollout_room(units("abcd"), [], 2) == 2
    assert rollout_room(units("cd"), ["a", "b"], 2) == 0
    assert rollout_room(units("bcd"), [], 2) == 1  # a is down for another reason: less to spare


def test_the_condition_says_up_to_date_rolling_out_or_halted_and_warns_once() -> None:
    spec = parse_spec(
        {
            "images": {"worker": "w", "synchronizer": "s"},
            "storage": {"bucket": "bkt"},
            "diloco": {"quorum": 2},
            "learnerUnits": [{"name": u} for u in UNITS],
        }
    )
    pods = [observe_pod(_pod(f"j-{u}-0", u, "new")) for u in UNITS]
    seen = unit_observations(spec, pods)
    done = rollout_condition([], RolloutPlan(), {}, seen, 2, NOW)
    assert (done.status, done.reason) == ("True", "UpToDate")
    going = rollout_condition([], RolloutPlan(("a", "b"), ("c", "d")), {}, seen, 2, NOW)
    assert (going.status, going.reason) == ("False", "RollingOut")
    assert going.message.startswith("restarting units a, b; units c, d wait for their turn")
    halted = RolloutPlan((), ("c", "d"), "the new pod template fails in unit a (...)")
    stopped = rollout_condition([going], halted, {"a": 1.0}, seen, 2, NOW)
    assert (stopped.status, stopped.reason, stopped.message) == ("False", "RolloutHalted", halted.halted)
    before, after = JobStatus(conditions=(going,)), JobStatus(conditions=(stopped,))
    assert [(e.type, e.reason, e.message) for e in diff_events(before, after)] == [
        ("Warning", "RolloutHalted", halted.halted)
    ]
    assert diff_events(after, after) == []
