"""`diloco run --mode ddp` end to end: the learners are the ranks of one torch.distributed unit; the
chaos schedule SIGKILLs one rank mid-run, the whole unit goes down, and it comes back from its last
checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.failures import failure_model_for, failure_schedule
from diloco.runner.timeline import Interval, Rollback, compute_goodput

SEED, MTBF_S, REPAIR_S, TIME_LIMIT_S = 2, 60.0, 4.0, 60.0
CHECKPOINT_EVERY = 10  # what the runner gives ddp workers (docs/run.md)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_unit_killed_by_chaos_restarts_from_its_checkpoint(tmp_path: Path) -> None:
    # the schedule is pure: with this seed rank 1 is killed once, after start-up, well before the end
    model = failure_model_for("ddp", learners=2, mtbf_s=MTBF_S, repair_s=REPAIR_S, seed=SEED)
    kills = failure_schedule(model, TIME_LIMIT_S)
    assert [(e.learner, round(e.at_s)) for e in kills] == [(1, 21)]
    argv = [
        sys.executable, "-m", "diloco", "run", "--mode", "ddp", "--learners", "2", "--max-steps", "100000",
        "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--mtbf", str(MTBF_S), "--repair", str(REPAIR_S),
        "--seed", str(SEED), "--time-limit", str(TIME_LIMIT_S), "--plain", "--runs-dir", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    report = json.loads((run_dir / "report.json").read_text())
    summary, record = report["summary"], report["record"]

    assert record["mode"] == "ddp"
    assert record["stop_reason"] == f"time limit of {TIME_LIMIT_S:g} s reached"
    # the kill and the restart: one kill of rank 1, restarted after the repair time, rejoined
    (kill,) = record["kills"]
    assert kill["learner"] == 1
    assert kill["restarted_at_s"] is not None
    assert kill["rejoined_at_s"] is not None
    assert kill["rejoined_at_s"] >= kill["restarted_at_s"] >= kill["at_s"] + REPAIR_S - 1.0
    assert "chaos: killed rank 1 of learner-0" in proc.stdout
    assert "ranks fail and restart together" in proc.stdout
    # every rank of the unit was launched twice: the kill took the whole unit down
    assert [learner["launches"] for learner in record["learners"]] == [2, 2]
    # it resumed from its newest checkpoint: a multiple of the checkpoint interval, at most one
    # interval before the step it was killed at, and above 0 (the unit had trained before the kill)
    rollbacks = record["timeline"]["rollbacks"]
    assert rollbacks, record["timeline"]
    for r in rollbacks:
        assert r["to_step"] > 0
        assert r["to_step"] % CHECKPOINT_EVERY == 0
        assert r["from_step"] - CHECKPOINT_EVERY <= r["to_step"] <= r["from_step"]
    resumed = [
        ln
        for ln in (run_dir / "logs" / "learner-0.log").read_text().splitlines()
        if "resumed from checkpoint" in ln
    ]
    assert len(resumed) == 1
    assert f"step={rollbacks[0]['to_step']} resumed from checkpoint" in resumed[0]

    # the ranks' gradient all-reduce is counted: a ring of 2 sends, and receives, each buffer once
    # per step, so each rank at least its parameters' fp32 bytes per step it took
    reduced = [learner["allreduce_bytes"] for learner in record["learners"]]
    assert reduced[0] == reduced[1] >= record["num_params"] * 4 * record["learners"][0]["steps"] // 2
    traffic = summary["traffic"]
    assert traffic["wire_sent"] >= sum(reduced)

    # the global model learned, and goodput is the timeline's
    assert summary["loss_went_down"] is True
    intervals = [
        Interval(i["learner"], i["phase"], i["start_s"], i["end_s"]) for i in record["timeline"]["intervals"]
    ]
    blocked = {(b["learner"], b["incarnation"]): b["blocked_s"] for b in record["timeline"]["blocked_s"]}
    recomputed = compute_goodput(
        intervals,
        blocked,
        [
            Rollback(r["learner"], r["at_s"], r["from_step"], r["to_step"], r["step_time_s"])
            for r in rollbacks
        ],
    )
    assert summary["goodput"]["goodput"] == pytest.approx(recomputed.goodput)
    assert 0.0 < summary["goodput"]["goodput"] < 1.0
    # both ranks were down from the kill until the unit was launched again (the runner applies
    # the schedule at its polling ticks, so the repair it measures can be a tick short of REPAIR_S)
    assert summary["goodput"]["down_s"] >= 2 * (kill["restarted_at_s"] - kill["at_s"]) - 0.01
