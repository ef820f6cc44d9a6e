"""`diloco bench attack` at a small size: its figures come from a real synchronizer process and say
what the rules promise (the bound held, the tries above it clipped to it, no id but its own for a
learner's token, every claim beyond what a token declares refused, no request read off a
learner's link used again, every step merged once)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from diloco_bench import attack

pytestmark = pytest.mark.integration


def test_the_attack_benchmark_reports_the_bound_held_and_every_step_merged_once(tmp_path: Path) -> None:
    out = tmp_path / "attack.json"
    argv = ["--scenarios", "bound,sybil,claims,capture,continuations", "--rounds", "12", "--ids", "3", "--seconds", "3",
            "--kills", "2", "--tries", "2", "--json", str(out)]  # fmt: skip
    assert attack.main(argv) == 0
    figures = json.loads(out.read_text())
    bound = figures["bound"]
    assert bound["largest_movement"] <= bound["bound"] * (1 + 1e-5)
    tried = int(bound["probes_above_the_limit_clipped"].split("/")[1])
    assert tried > 0
    assert bound["probes_above_the_limit_clipped"] == f"{tried}/{tried}"
    assert bound["after_kill9_5x_params_norm_clipped"] is True
    assert bound["adversary_merged"] == bound["rounds"]  # clipped, never left out
    assert (figures["sybil"]["registrations_tried"], figures["sybil"]["registered"]) == (6, 0)
    claims = figures["claims"]
    assert claims["tries_of_each"] == 2
    refused = {k: v for k, v in claims.items() if k.endswith("_refused")}
    assert len(refused) == 5, claims
    assert set(refused.values()) == {2}, claims
    assert claims["honest_and_x_within_its_claims_merged"] is True
    capture = figures["capture"]
    replays = {k: v for k, v in capture.items() if k.endswith("_refused")}
    assert len(replays) == 7, capture  # another shard and a restart among them
    assert set(replays.values()) == {2}, capture  # nothing read off the learner's link is used again
    assert capture["learner_still_served"] is True
    parts = figures["continuations"]
    assert parts["kills"] == 2
    assert parts["steps_acknowledged"] > 0
    assert (parts["steps_merged_twice"], parts["steps_unaccounted"]) == (0, 0)
    accounted = (
        parts["steps_merged"] + parts["steps_superseded_by_a_newer_version"] + parts["steps_still_pending"]
    )
    assert accounted == parts["steps_acknowledged"]
    assert parts["other_refused"] == {}  # the learner keeping the quorum sends its steps in order


def test_an_unknown_scenario_is_refused() -> None:
    assert attack.main(["--scenarios", "bound,nope"]) == 2
