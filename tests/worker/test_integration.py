"""Real learner processes against a real synchronizer process, on the CPU with a tiny model."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from diloco_testbed.ports import free_port
from diloco_testbed.process import ManagedProcess, stop_all
from diloco_testbed.waiting import wait_for
from diloco_worker.checkpoint import list_checkpoints, open_checkpoint_store

from tests.worker.helpers import (
    Synchronizer,
    held_out_loss,
    iter_logs,
    learner_process,
    metric_step,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
H, P = 8, 2
PLAN = [
    "--inner-steps",
    str(H),
    "--fragments",
    str(P),
    "--overlap",
    "1",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "10",
]


def _alive(*procs: ManagedProcess) -> None:
    for proc in procs:
        if not proc.running():
            raise AssertionError(proc.failure_report())


def _wait_step(proc: ManagedProcess, metrics: Path, at_least: int, timeout: float = 240) -> int:
    def probe() -> int | None:
        _alive(proc)
        step = metric_step(metrics)
        return step if step >= at_least else None

    return wait_for(
        probe, timeout=timeout, what=f"{proc.name} at step {at_least}", describe=proc.failure_report
    )


def _finish(proc: ManagedProcess, timeout: float = 120) -> int | None:
    deadline = time.monotonic() + timeout
    while proc.running() and time.monotonic() < deadline:
        time.sleep(0.5)
    return proc.returncode()


@pytest.mark.parametrize("slow", [1, 20], ids=["alike", "one_20x_slower"])
def test_two_learners_lower_the_held_out_loss_of_the_global_model(tmp_path: Path, slow: int) -> None:
    # K = 2: every round merges both learners (with K = 1 and plain Nesterov, single-learner rounds
    # make the outer momentum overshoot on a run this short, and the result varies from run to run).
    # The learners train until every fragment has had enough rounds rather than for a fixed number
    # of steps, so a learner that starts late on a loaded machine still overlaps with the other.
    # With one learner 20x slower, each round takes a part of a step or two of it (small early in
    # its learning-rate warm-up, the lower median of the round's norms) and many steps of the other:
    # both are merged in every round, the other's clipped when above the limit the parts set (when
    # it was excluded instead, a fragment merged only the slow learner's parts in all its rounds).
    sync = Synchronizer(tmp_path, inner_steps=H, fragments=P, quorum=2)
    sync.start()
    rounds = 12
    learners = [
        learner_process(
            tmp_path,
            f"l{i}",
            sync.url,
            [
                *PLAN,
                "--max-steps",
                "2000",
                "--learner-index",
                str(i),
                "--num-learners",
                "2",
                "--speed-factor",
                str(slow if i == 1 else 1),
            ],
        )  # fmt: skip
        for i in range(2)
    ]
    try:
        for lr in learners:
            lr.start()

        def enough_rounds() -> dict[int, int] | None:
            _alive(*learners)
            versions = sync.versions()
            return versions if versions and all(v >= rounds for v in versions.values()) else None

        wait_for(enough_rounds, timeout=540, what=f"{rounds} rounds on every fragment")
        for lr in learners:
            assert lr.pid is not None
            os.kill(lr.pid, signal.SIGTERM)
        for lr in learners:
            assert _finish(lr, timeout=120) == 0, lr.failure_report()
        status = sync.status()
        by_id = {x["learner_id"]: x for x in status["learners"]}
        assert all(x["step"] >= (rounds * H // P if slow == 1 else rounds) for x in by_id.values()), by_id
        assert all(x["state"] == "left" for x in by_id.values())
        assert all(x["bytes_sent"] > 0 for x in by_id.values())
        start, end = held_out_loss(None), held_out_loss(sync.global_params())
        print(f"held-out loss of the global model: {start:.3f} -> {end:.3f}")
        merged = [
            (
                r["fragment"],
                r["version"],
                r["participants"],
                r["base_versions"],
                r["steps"],
                r["update_norm"],
                [x["reason"] for x in r["excluded"]],
            )
            for r in status["recent_rounds"]
        ]  # what each round merged, and what its checks left out: the failure says why
        assert all(sorted(r["participants"]) == ["l0", "l1"] for r in status["recent_rounds"]), merged
        assert not any(r["excluded"] for r in status["recent_rounds"]), merged
        assert end < start - 1.0, (start, end, merged)
    finally:
        stop_all([*learners])
        sync.stop()


def test_a_learner_killed_hard_resumes_and_rejoins_while_the_other_keeps_going(tmp_path: Path) -> None:
    sync = Synchronizer(tmp_path, inner_steps=H, fragments=P)
    sync.start()
    flags = [*PLAN, "--max-steps", "100000", "--checkpoint-every", "5"]
    a = learner_process(tmp_path, "a", sync.url, [*flags, "--checkpoint-dir", str(tmp_path / "ck-a")])
    b = learner_process(tmp_path, "b", sync.url, [*flags, "--checkpoint-dir", str(tmp_path / "ck-b")])
    try:
        a.start()
        b.start()
        _wait_step(a, tmp_path / "a.jsonl", 12)
        assert a.pid is not None
        os.kill(a.pid, signal.SIGKILL)
        wait_for(lambda: not a.running(), timeout=30, what="a exits after SIGKILL")
        killed_at = metric_step(tmp_path / "a.jsonl")
        b_at_kill = metric_step(tmp_path / "b.jsonl")
        _wait_step(b, tmp_path / "b.jsonl", b_at_kill + 10)  # b keeps training during the outage
        assert not a.running()
        # checkpoints are written in the background and skipped while one is still being written,
        # so the newest complete one may be more than --checkpoint-every behind the kill
        on_disk = list_checkpoints(open_checkpoint_store(str(tmp_path / "ck-a")))
        assert on_disk, "a wrote no complete checkpoint before the kill"
        a.start()
        wait_for(
            lambda: any("resumed from checkpoint" in ln for ln in iter_logs(a)),
            timeout=120,
            what="a resumes from its checkpoint",
            describe=a.failure_report,
        )
        resumed = [ln for ln in iter_logs(a) if "resumed from checkpoint" in ln][-1]
        resumed_step = int(resumed.split("step=")[1].split()[0])
        assert resumed_step == on_disk[-1] <= killed_at  # the newest complete checkpoint
        assert resumed_step % 5 == 0
        _wait_step(a, tmp_path / "a.jsonl", killed_at + 10)
        wait_for(
            lambda: sync.learner_steps().get("a", 0) > killed_at,
            timeout=60,
            what="a reports to the synchronizer",
        )
        for proc in (a, b):
            proc.stop(timeout=90)
            assert proc.returncode() == 0, proc.failure_report()
        states = {x["learner_id"]: x["state"] for x in sync.status()["learners"]}
        assert states == {"a": "left", "b": "left"}
    finally:
        stop_all([a, b])
        sync.stop()


def test_learners_keep_stepping_while_the_synchronizer_is_down_and_catch_up(tmp_path: Path) -> None:
    sync = Synchronizer(tmp_path, inner_steps=H, fragments=P)
    sync.start()
    a = learner_process(tmp_path, "a", sync.url, [*PLAN, "--max-steps", "100000"])
    try:
        a.start()
        _wait_step(a, tmp_path / "a.jsonl", 2 * H + 2)
        wait_for(lambda: min(sync.versions().values()) >= 1, timeout=120, what="first merges")
        before = sync.versions()
        sync.stop()
        down_at = metric_step(tmp_path / "a.jsonl")
        _wait_step(a, tmp_path / "a.jsonl", down_at + 2 * H)  # trains on, through more than one sync point
        sync.start()
        wait_for(
            lambda: all(v > before[p] for p, v in sync.versions().items()),
            timeout=180,
            what="merges resume after the outage",
            describe=a.failure_report,
        )
        wait_for(lambda: sync.learner_steps().get("a", 0) > down_at, timeout=60, what="heartbeats resume")
        assert any("will retry" in ln for ln in iter_logs(a))
        a.stop(timeout=90)
        assert a.returncode() == 0, a.failure_report()
    finally:
        stop_all([a])
        sync.stop()


def test_two_process_unit_trains_and_only_rank_0_talks_to_the_synchronizer(tmp_path: Path) -> None:
    sync = Synchronizer(tmp_path, inner_steps=H, fragments=P)
    sync.start()
    port = free_port()
    unit_env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    flags = [*PLAN, "--max-steps", "30", "--unit", "unit-a"]
    rank0 = learner_process(tmp_path, "unit-a", sync.url, flags, env={**unit_env, "RANK": "0"})
    # rank 1 gets an address where nothing listens: it must never need the synchronizer
    dead_url = f"http://127.0.0.1:{free_port()}"
    rank1 = learner_process(tmp_path / "r1", "unit-a", dead_url, flags, env={**unit_env, "RANK": "1"})
    try:
        rank0.start()
        rank1.start()
        assert _finish(rank0, timeout=400) == 0, rank0.failure_report()
        assert _finish(rank1, timeout=60) == 0, rank1.failure_report()
        learners = sync.status()["learners"]
        assert [x["learner_id"] for x in learners] == ["unit-a"]
        assert learners[0]["step"] == 30
        assert learners[0]["tokens"] == 30 * 2 * 8 * 32  # both ranks' tokens
        assert min(sync.versions().values()) >= 2
        rank1_log = "\n".join(iter_logs(rank1))
        assert "rank=1/2" in rank1_log
        assert "will retry" not in rank1_log
        assert "applied" in rank1_log  # rank 1 took the global fragments rank 0 broadcast
    finally:
        stop_all([rank0, rank1])
        sync.stop()


def _resumed_at(proc: ManagedProcess) -> int:
    lines = [ln for ln in iter_logs(proc) if "resumed from checkpoint" in ln]
    assert lines, proc.failure_report()
    return int(lines[-1].split("step=")[1].split()[0])


def _last_checkpoint(proc: ManagedProcess) -> int:
    lines = [ln for ln in iter_logs(proc) if "checkpoint written" in ln]
    assert lines, proc.failure_report()
    return int(lines[-1].split("step=")[1].split()[0])


def test_a_unit_resized_from_one_process_to_two_and_back_keeps_its_progress(tmp_path: Path) -> None:
    """The leader's checkpoint folder is the same whatever the unit's size (the operator gives each pod
    its own), so the unit resumes from the newest step it reached as one process or as two, and the
    synchronizer counts every token the unit trained once."""
    sync = Synchronizer(tmp_path, inner_steps=H, fragments=P)
    sync.start()
    flags = [*PLAN, "--max-steps", "48", "--checkpoint-every", "4", "--unit", "unit-a"]
    pod0 = [*flags, "--checkpoint-dir", str(tmp_path / "ck" / "unit-a-0")]
    pod1 = [*flags, "--checkpoint-dir", str(tmp_path / "ck" / "unit-a-1")]
    unit_env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for folder in ("one", "two", "two-1", "again"):
        (tmp_path / folder).mkdir()
    # each size leaves at a set step (checkpoint, goodbye: what a SIGTERM does), so none can reach
    # --max-steps and be ending on its own when a signal would come
    one = learner_process(tmp_path / "one", "unit-a", sync.url, [*pod0, "--stop-at-step", "12"])
    as_two_flags = ["--stop-at-step", "20"]
    rank0 = learner_process(
        tmp_path / "two", "unit-a", sync.url, [*pod0, *as_two_flags], env={**unit_env, "RANK": "0"}
    )
    rank1 = learner_process(
        tmp_path / "two-1", "unit-a", sync.url, [*pod1, *as_two_flags], env={**unit_env, "RANK": "1"}
    )
    again = learner_process(tmp_path / "again", "unit-a", sync.url, pod0)
    per_process_step = 8 * 32  # TINY_FLAGS: batch 8, context 32
    try:
        one.start()
        assert _finish(one, timeout=300) == 0, one.failure_report()
        as_one = _last_checkpoint(one)
        assert as_one == 12

        rank0.start()
        rank1.start()
        assert (_finish(rank0, timeout=300), _finish(rank1, timeout=60)) == (0, 0), rank1.failure_report()
        assert _resumed_at(rank0) == _resumed_at(rank1) == as_one
        assert any(f"data cursor {as_one} -> {-(-as_one // 2)}" in ln for ln in iter_logs(rank1))
        as_two = _last_checkpoint(rank0)
        assert _last_checkpoint(rank1) == as_two

        again.start()
        assert _finish(again, timeout=400) == 0, again.failure_report()
        assert _resumed_at(again) == as_two
        learner = sync.status()["learners"][0]
        assert learner["step"] == 48
        two_steps = as_two - as_one
        assert learner["tokens"] == (as_one + 2 * two_steps + 48 - as_two) * per_process_step
    finally:
        stop_all([one, rank0, rank1, again])
        sync.stop()
