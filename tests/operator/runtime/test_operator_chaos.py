"""Pure chaos decisions: two keys (operator and job), Poisson failures per unit, repair windows."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from diloco_operator.runtime.chaos import (
    ChaosUnit,
    Gate,
    PodRef,
    chaos_gate,
    chaos_units,
    failure_probability,
    gate_events,
    pick_victims,
    repaired,
)
from diloco_operator.schema.spec import ChaosSpec, parse_spec
from diloco_operator.schema.status import JobStatus

PODS = [PodRef(f"j-{u}-{i}", u, True) for u in ("a", "b") for i in range(2)]


def spec(chaos: dict[str, object]) -> object:
    return parse_spec(
        {
            "images": {"worker": "w", "synchronizer": "s"},
            "storage": {"bucket": "bkt"},
            "learnerUnits": [{"name": "a"}, {"name": "b"}],
            "chaos": chaos,
        }
    )


def test_off_by_default_and_unless_enabled() -> None:
    s = spec({})
    assert chaos_units(s.chaos, s, {}) == []  # type: ignore[attr-defined]
    s = spec({"enabled": False, "mtbfSeconds": 1})
    assert chaos_units(s.chaos, s, {}) == []  # type: ignore[attr-defined]


def test_enabled_units_default_to_all_or_the_listed_ones() -> None:
    s = spec({"enabled": True, "mtbfSeconds": 30})
    assert [u.name for u in chaos_units(s.chaos, s, {})] == ["a", "b"]  # type: ignore[attr-defined]
    s = spec({"enabled": True, "units": ["b"]})
    assert [u.name for u in chaos_units(s.chaos, s, {"b": 5.0})] == ["b"]  # type: ignore[attr-defined]
    assert chaos_units(s.chaos, s, {"b": 5.0})[0].down_until == 5.0  # type: ignore[attr-defined]


def test_failure_probability_is_poisson() -> None:
    assert failure_probability(0, 10) == 0.0
    assert math.isclose(failure_probability(10, 10), 1 - math.exp(-1))
    assert failure_probability(10_000, 10) == failure_probability(300, 10)  # bounded burst


def test_rate_matches_mtbf() -> None:
    rng = random.Random(7)
    units = [ChaosUnit("a", 100.0)]
    kills = sum(len(pick_victims(units, PODS, t + 10.0, rng, last_tick=t)) for t in range(0, 200_000, 10))
    # 20000 ticks of 10 s with MTBF 100 s: expected 20000 * (1 - e^-0.1) = 1903
    assert 1750 < kills < 2050


def test_one_victim_per_unit_running_pods_only_and_reproducible() -> None:
    units = [ChaosUnit("a", 0.001), ChaosUnit("b", 0.001)]
    pods = [*PODS, PodRef("j-a-9", "a", False)]
    first = pick_victims(units, pods, 10.0, random.Random(1), last_tick=0.0)
    assert sorted(v.unit for v in first) == ["a", "b"]
    assert all(v.pod in {p.name for p in PODS} for v in first)
    assert pick_victims(units, pods, 10.0, random.Random(1), last_tick=0.0) == first


def test_units_under_repair_or_without_pods_are_spared() -> None:
    units = [ChaosUnit("a", 0.001, down_until=20.0), ChaosUnit("c", 0.001)]
    assert pick_victims(units, PODS, 10.0, random.Random(1), last_tick=0.0) == []
    assert repaired({"a": 20.0, "b": 5.0}, 10.0) == {"a": 20.0}


@pytest.mark.parametrize(
    ("chaos", "allowed", "expected"),
    [
        ({}, False, None),  # nothing asked
        ({}, True, None),
        (
            {"enabled": False, "mtbfSeconds": 600, "repairSeconds": 0},
            True,
            None,
        ),  # the CRD's defaults, filled in
        ({"enabled": True, "mtbfSeconds": 30}, True, (True, "Enabled")),  # both keys
        ({"enabled": True}, False, (False, "NotAllowed")),  # the operator's key missing
        ({"mtbfSeconds": 30}, True, (False, "NotEnabled")),  # the job's key missing
        ({"units": ["a"]}, False, (False, "NotEnabled")),
        ({"enabled": False, "repairSeconds": 60}, True, (False, "NotEnabled")),
    ],
    ids=[
        "none",
        "none-allowed",
        "crd-defaults",
        "both",
        "operator-refuses",
        "mtbf-not-enabled",
        "units-not-enabled",
        "repair-not-enabled",
    ],
)
def test_chaos_runs_only_with_both_keys(
    chaos: dict[str, Any], allowed: bool, expected: tuple[bool, str] | None
) -> None:
    gate = chaos_gate(ChaosSpec.model_validate(chaos), allowed)
    assert (None if gate is None else (gate.active, gate.reason)) == expected


def test_refusal_messages_say_what_to_change() -> None:
    refused = chaos_gate(ChaosSpec.model_validate({"enabled": True}), False)
    assert refused is not None
    assert "--allow-chaos" in refused.message
    assert "operator.allowChaos" in refused.message
    not_enabled = chaos_gate(ChaosSpec.model_validate({"mtbfSeconds": 5}), True)
    assert not_enabled is not None
    assert "enabled: true" in not_enabled.message


def test_a_refusal_is_reported_once_per_reason() -> None:
    refused = Gate(False, "NotAllowed", "no")
    assert [e.reason for e in gate_events(JobStatus(), refused)] == ["ChaosRefused"]
    before = JobStatus.read({"conditions": [{"type": "Chaos", "status": "False", "reason": "NotAllowed"}]})
    assert gate_events(before, refused) == []
    assert [e.reason for e in gate_events(before, Gate(False, "NotEnabled", "no"))] == ["ChaosNotEnabled"]
    assert gate_events(before, Gate(True, "Enabled", "yes")) == []
