"""The queue benchmark's accounting (quota and running unit-seconds, tokens per phase) and what it
reads from the cluster (which learners' pods run, the two shapes of the job)."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_bench.queue_cluster import job_manifest, learner_of, running_learners
from diloco_bench.queue_goodput import PHASES, ModeResult, Sample, table, tokens_at, unit_seconds


def test_running_unit_seconds_hold_each_sample_until_the_next_and_clip_to_the_window() -> None:
    samples = [Sample(0.0, 0, 0), Sample(2.0, 2, 10), Sample(5.0, 4, 40), Sample(8.0, 0, 70)]
    assert unit_seconds(samples, 0.0, 8.0) == 2 * 3 + 4 * 3
    assert unit_seconds(samples, 3.0, 6.0) == 2 * 2 + 4 * 1
    assert unit_seconds(samples, 8.0, 10.0) == 0
    assert unit_seconds([Sample(1.0, 3, 0)], 0.0, 4.0) == 9  # the last sample holds to the end
    assert tokens_at(samples, 4.9) == 10
    assert tokens_at(samples, 5.0) == 40
    assert tokens_at(samples, -1.0) == 0


def test_goodput_is_tokens_per_unit_second_of_the_quota_the_job_could_use() -> None:
    # 2 + 4 + 3 (the urgent pod holds one) + 4 learner pods of quota, 10 s each
    result = ModeResult("elastic", 10.0, samples=[Sample(0.0, 2, 0), Sample(10.0, 4, 100)], tokens=650)
    assert [p.share for p in PHASES] == [2, 4, 3, 4]
    assert result.quota_unit_s == 130.0
    assert result.goodput == 5.0
    result.samples += [Sample(20.0, 3, 300), Sample(30.0, 4, 450), Sample(40.0, 0, 650)]
    assert result.running_unit_s == 20 + 40 + 30 + 40
    assert result.phases() == [
        ("quota 2", 2.0, 100),
        ("quota 4", 4.0, 200),
        ("quota 4, 1 preempted", 3.0, 150),
        ("quota 4 again", 4.0, 200),
    ]
    assert "| elastic | 650 | 130 | 5.0 | 130 | 5.0 | 0 |" in table([result])


def pod(name: str, unit: str, phase: str = "Running", deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {"diloco.dev/unit": unit}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase}}


def test_the_learners_whose_pods_run() -> None:
    assert learner_of(pod("queue-elastic-c-0", "c")) == 2
    assert learner_of(pod("queue-whole-all-3", "all")) == 3
    assert learner_of(pod("other-x-0", "x")) is None
    pods = [
        pod("j-a-0", "a"),
        pod("j-b-0", "b", phase="Pending"),  # gated by Kueue
        pod("j-c-0", "c", deleting=True),  # preempted, going
        pod("j-d-0", "d"),
    ]
    assert running_learners(pods) == {0, 3}


def test_the_elastic_job_has_a_unit_per_learner_and_the_whole_job_one_unit_of_all() -> None:
    elastic = job_manifest("e", "elastic", "low")["spec"]
    whole = job_manifest("w", "whole", "low")["spec"]
    assert [(u["name"], u["replicas"]) for u in elastic["learnerUnits"]] == [(n, 1) for n in "abcd"]
    assert [(u["name"], u["replicas"]) for u in whole["learnerUnits"]] == [("all", 4)]
    for spec in (elastic, whole):
        assert spec["queueName"] == "team"
        assert spec["workloadPriorityClassName"] == "low"
        assert all(u["resources"]["requests"]["cpu"] == "1" for u in spec["learnerUnits"])
    with pytest.raises(ValueError, match="unknown mode"):
        job_manifest("x", "gang", "low")
