"""`diloco run` end to end: a real synchronizer and real learner processes, with learners killed
(SIGKILL) and restarted by the chaos schedule."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from diloco.failures import failure_model_for, failure_schedule
from diloco.runner.timeline import Interval, Rollback, compute_goodput
from tests.support.tensorboard_files import read_scalars

SEED, MTBF_S, REPAIR_S = 3, 20.0, 3.0


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_local_job_with_chaos_heals_and_reports(tmp_path: Path) -> None:
    # the schedule is pure: with this seed learners 1 and 0 are killed within the first 8 seconds
    model = failure_model_for("decoupled", learners=3, mtbf_s=MTBF_S, repair_s=REPAIR_S, seed=SEED)
    early = {e.learner for e in failure_schedule(model, 8.0)}
    assert len(early) >= 2
    argv = [
        sys.executable,
        "-m",
        "diloco",
        "run",
        "--learners",
        "3",
        "--max-steps",
        "200",
        "--inner-steps",
        "8",
        "--fragments",
        "2",
        "--overlap",
        "1",
        "--mtbf",
        str(MTBF_S),
        "--repair",
        str(REPAIR_S),
        "--seed",
        str(SEED),
        # each step eight times its compute, so that the kills find the learners still training: at
        # full speed a quiet machine takes them through 200 steps in 4 s, past the second kill's 7 s
        "--speed-factors",
        "8,8,8",
        "--time-limit",
        "420",
        "--plain",
        "--runs-dir",
        str(tmp_path),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert (run_dir / "report.md").read_text() in proc.stdout
    assert (run_dir / "loss.png").stat().st_size > 0
    report = json.loads((run_dir / "report.json").read_text())
    summary, record = report["summary"], report["record"]

    assert record["stop_reason"] == "every learner reached --max-steps"
    assert all(learner["finished"] for learner in record["learners"])
    # every killed learner came back and trained again
    assert len(summary["killed_learners"]) >= 2
    assert summary["unrejoined"] == []
    for kill in record["kills"]:
        if kill["killed_again_at_s"] is not None:  # killed again while still coming back
            assert kill["rejoined_at_s"] is None
            assert kill["killed_again_at_s"] >= kill["at_s"]
            continue
        assert kill["restarted_at_s"] is not None
        assert kill["rejoined_at_s"] is not None
        assert kill["rejoined_at_s"] >= kill["restarted_at_s"] >= kill["at_s"] + REPAIR_S - 1.0
    assert sum(learner["launches"] for learner in record["learners"]) == 3 + len(record["kills"])

    # the global model learned
    assert summary["loss_went_down"] is True
    assert summary["final_loss"] < summary["first_loss"] - 0.3

    # goodput comes from what happened: below 1 with kills, and equal to the timeline's numbers
    intervals = [
        Interval(i["learner"], i["phase"], i["start_s"], i["end_s"]) for i in record["timeline"]["intervals"]
    ]
    down = sum(i.duration_s for i in intervals if i.phase == "down")
    assert down >= REPAIR_S * len(record["kills"]) * 0.9
    blocked = {(b["learner"], b["incarnation"]): b["blocked_s"] for b in record["timeline"]["blocked_s"]}
    rollbacks = [
        Rollback(r["learner"], r["at_s"], r["from_step"], r["to_step"], r["step_time_s"])
        for r in record["timeline"]["rollbacks"]
    ]
    recomputed = compute_goodput(intervals, blocked, rollbacks)
    assert summary["goodput"]["goodput"] == pytest.approx(recomputed.goodput)
    assert 0.0 < summary["goodput"]["goodput"] < 1.0
    training = sum(i.duration_s for i in intervals if i.phase == "training")
    total = sum(i.duration_s for i in intervals)
    assert summary["goodput"]["goodput"] == pytest.approx(
        (training - min(sum(blocked.values()), training) - sum(r.lost_s for r in rollbacks)) / total
    )

    # bytes: measured uploads against the data-parallel formula
    traffic = summary["traffic"]
    assert traffic["sent_bytes"] > 0
    assert traffic["data_parallel_bytes"] == record["num_params"] * 2 * 2 * summary["total_learner_steps"]
    assert traffic["reduction_up"] > 1.0
    # at the socket: more than the payload sent (heads, heartbeats, long-polls, the initial upload);
    # downloads served to a learner that chaos killed mid-transfer count in the payload served but
    # never reached it, so the two directions are not ordered alike under chaos
    assert traffic["wire_sent"] > traffic["sent_bytes"] > 0
    assert traffic["wire_received"] > 0.9 * traffic["received_bytes"] > 0

    # TensorBoard: one run per learner (its restarts append new event files) and the synchronizer's
    board = run_dir / "tensorboard"
    assert sorted(p.name for p in board.iterdir()) == [
        "learner-0",
        "learner-1",
        "learner-2",
        "synchronizer-0",
    ]
    for learner in record["learners"]:
        runs = read_scalars(board / learner["learner_id"])
        assert runs["loss"][-1][0] == 200, learner["learner_id"]  # up to the last step
        # an event file per process that got as far as opening it (one killed at start-up may not)
        assert 1 <= len(list((board / learner["learner_id"]).iterdir())) <= learner["launches"]
    assert "fragment_0/merged_tokens" in read_scalars(board / "synchronizer-0")
    assert "eta=" in proc.stdout
