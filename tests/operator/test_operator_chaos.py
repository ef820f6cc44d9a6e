"""Pure chaos decisions: Poisson failures per unit, repair windows, off unless enabled."""

from __future__ import annotations

import math
import random

from diloco_operator.chaos import ChaosUnit, PodRef, chaos_units, failure_probability, pick_victims, repaired
from diloco_operator.models import parse_spec

PODS = [PodRef(f"j-{u}-{i}", u, True) for u in ("a", "b") for i in range(2)]


def spec(chaos: dict[str, object]) -> object:
    return parse_spec({"images": {"worker": "w", "synchronizer": "s"}, "storage": {"bucket": "bkt"},
                       "learnerUnits": [{"name": "a"}, {"name": "b"}], "chaos": chaos})


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
