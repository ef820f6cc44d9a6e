"""A real learner against a synchronizer split into two real shard processes, given only shard 0."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from diloco_testbed.ports import free_ports
from diloco_testbed.process import ManagedProcess, stop_all
from diloco_testbed.waiting import wait_for

from tests.worker.helpers import Synchronizer, iter_logs, learner_process, metric_step

pytestmark = [pytest.mark.integration, pytest.mark.slow]
H, P = 8, 2  # fragment 0 belongs to shard 0, fragment 1 to shard 1
PLAN = ["--inner-steps", str(H), "--fragments", str(P), "--overlap", "1", "--max-steps", "100000"]


def _alive(proc: ManagedProcess) -> None:
    if not proc.running():
        raise AssertionError(proc.failure_report())


def _advanced(shard: Synchronizer, learner: ManagedProcess, beyond: int) -> bool:
    _alive(learner)
    return all(v > beyond for v in shard.versions().values())


def _shard(folder: Path, index: int, ports: list[int]) -> Synchronizer:
    """Shard ``index`` of a synchronizer split over ``ports``; storage and log in ``folder``."""
    urls = ",".join(f"http://127.0.0.1:{port}" for port in ports)
    flags = ["--num-shards", str(len(ports)), "--shard-index", str(index), "--shard-urls", urls]
    # DEBUG: the access log shows every answer's status code
    return Synchronizer(
        folder, inner_steps=H, fragments=P, port=ports[index], extra=[*flags, "--log-level", "DEBUG"]
    )


def _rounds_on_both(shards: list[Synchronizer], learner: ManagedProcess, beyond: int) -> None:
    for shard in shards:
        wait_for(
            functools.partial(_advanced, shard, learner, beyond),
            timeout=240,
            what=f"fragment versions past {beyond} on shard {shard.url}",
            describe=learner.failure_report,
        )


def test_a_learner_given_shard_0_syncs_every_fragment_with_its_owner_and_outlives_a_shard(
    tmp_path: Path,
) -> None:
    ports = free_ports(2)
    shards = [_shard(tmp_path / f"shard-{i}", i, ports) for i in range(2)]
    metrics = tmp_path / "a.jsonl"
    learner = learner_process(tmp_path, "a", shards[0].url, PLAN, env={"DILOCO_LOG_LEVEL": "DEBUG"})
    try:
        for shard in shards:
            shard.start()
        learner.start()
        _rounds_on_both(shards, learner, 1)  # rounds happen on both shards
        assert [list(s.versions()) for s in shards] == [[0], [1]]
        assert [list(s.learner_steps()) for s in shards] == [["a"], ["a"]]  # registered with both

        # shard 1 goes away: the fragment shard 0 owns keeps its rounds, the learner keeps training
        shards[1].stop()
        v0, down_at = shards[0].versions()[0], metric_step(metrics)
        wait_for(lambda: _advanced(shards[0], learner, v0 + 1), timeout=240, what="shard 0 rounds go on")
        assert metric_step(metrics) > down_at
        shards[1].start()
        back = shards[1].versions()[1]
        wait_for(lambda: _advanced(shards[1], learner, back), timeout=240, what="shard 1 rounds resume")

        learner.stop(timeout=90)
        assert learner.returncode() == 0, learner.failure_report()
        for shard in shards:
            assert [(x["learner_id"], x["state"]) for x in shard.status()["learners"]] == [("a", "left")]
    finally:
        stop_all([learner])
        for shard in shards:
            shard.stop()

    log = list(iter_logs(learner))
    assert not [ln for ln in log if "wrong_shard" in ln or "HTTP 421" in ln]
    assert any("shard=1 heartbeat failed" in ln for ln in log)  # failures are in this log, at DEBUG
    for shard in shards:
        access = [ln for ln in iter_logs(shard.proc) if '"POST /v1/' in ln or '"GET /v1/' in ln]
        assert any('" 200' in ln for ln in access)
        assert not [ln for ln in access if '" 421' in ln]


def test_a_shard_that_lost_its_registry_gets_the_learner_back_and_its_rounds_resume(tmp_path: Path) -> None:
    """Shard 1 comes back on its address with empty storage (it knows neither the learner nor the
    fragment): the learner's heartbeats to shard 1 answer 404, it registers with shard 1 again,
    uploads fragment 1's parameters there, and shard 1's rounds start over; shard 0 is not disturbed."""
    ports = free_ports(2)
    shards = [_shard(tmp_path / f"shard-{i}", i, ports) for i in range(2)]
    learner = learner_process(tmp_path, "a", shards[0].url, PLAN)
    try:
        for shard in shards:
            shard.start()
        learner.start()
        _rounds_on_both(shards, learner, 1)
        shards[1].stop()
        shards[1] = _shard(tmp_path / "shard-1-fresh", 1, ports)
        shards[1].start()
        _rounds_on_both(shards, learner, 1)
        assert shards[1].learner_steps().keys() == {"a"}
        learner.stop(timeout=90)
        assert learner.returncode() == 0, learner.failure_report()
    finally:
        stop_all([learner])
        for shard in shards:
            shard.stop()
    log = list(iter_logs(learner))
    assert any("shard=1 does not know this learner" in ln for ln in log)
    assert not [ln for ln in log if "shard=0 does not know this learner" in ln]
