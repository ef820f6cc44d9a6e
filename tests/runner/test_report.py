import json
from pathlib import Path

import pytest

from diloco.runner.record import KillRecord, LearnerTotals, LossSample, RunRecord
from diloco.runner.report import build_report, render_markdown
from diloco.runner.report_files import write_report
from diloco.runner.timeline import Rollback, Timeline


def synthetic_record(run_dir: Path) -> RunRecord:
    """Two learners for 100 s; learner 1 is killed at 40 s, restarted at 50 s, trains from 55 s."""
    timeline = Timeline()
    timeline.enter(0, "starting", 0.0)
    timeline.enter(1, "starting", 0.0)
    timeline.enter(0, "training", 5.0)
    timeline.enter(1, "training", 5.0)
    timeline.enter(1, "down", 40.0)
    timeline.enter(1, "starting", 50.0)
    timeline.enter(1, "training", 55.0)
    timeline.record_blocked(0, 0, 2.0)
    timeline.record_blocked(1, 0, 1.0)
    timeline.rollbacks.append(Rollback(1, 55.0, from_step=120, to_step=110, step_time_s=0.3))
    timeline.close(100.0)
    record = RunRecord(
        run_dir=str(run_dir),
        mode="decoupled",
        settings={"learners": 2},
        started_at=0.0,
        duration_s=100.0,
        stop_reason="every learner reached --max-steps",
        num_params=1000,
        tokens_per_step=512,
    )
    record.timeline = timeline
    record.learners = [
        LearnerTotals(0, "learner-0", 1.0, None, steps=300, tokens=300 * 512, launches=1, finished=True),
        LearnerTotals(1, "learner-1", 1.18, 5e5, steps=250, tokens=250 * 512, launches=2, finished=True),
    ]
    record.kills = [KillRecord(1, 40.0, 120, restarted_at_s=50.0, rejoined_at_s=55.0)]
    record.losses = [
        LossSample(6.0, 1000, 5.5),
        LossSample(50.0, 100_000, 3.0),
        LossSample(100.0, 281_600, 2.5),
    ]
    record.sent_bytes, record.received_bytes, record.rounds = 44_000, 400_000, 40
    record.wire_sent_bytes, record.wire_received_bytes = 55_000, 550_000
    return record


def test_report_numbers_come_from_the_timeline(tmp_path: Path) -> None:
    report = build_report(synthetic_record(tmp_path))
    g = report.goodput
    assert g.total_s == pytest.approx(200.0)
    assert g.down_s == pytest.approx(10.0)
    assert g.starting_s == pytest.approx(15.0)
    assert g.training_s == pytest.approx(175.0)
    assert g.blocked_s == pytest.approx(3.0)
    assert g.lost_s == pytest.approx(3.0)
    assert g.goodput == pytest.approx((175 - 3 - 3) / 200)
    # start-up: both learners' first 5 s; the steady state is the rest
    assert g.startup_s == pytest.approx(10.0)
    assert g.steady_goodput == pytest.approx((175 - 3 - 3) / 190)
    assert report.traffic.data_parallel_bytes == 1000 * 2 * 2 * 550  # bf16, each way
    assert report.traffic.reduction_up == pytest.approx(2_200_000 / 55_000)  # at the socket
    assert report.traffic.reduction_down == pytest.approx(2_200_000 / 550_000)
    assert report.traffic.payload_reduction_up == pytest.approx(2_200_000 / 44_000)
    assert report.traffic.payload_reduction_down == pytest.approx(2_200_000 / 400_000)
    assert report.loss_went_down is True
    assert report.killed_learners == [1]
    assert report.unrejoined == []


def test_a_learner_whose_last_kill_never_rejoined_is_reported(tmp_path: Path) -> None:
    record = synthetic_record(tmp_path)
    record.kills.append(KillRecord(1, 90.0, 280))
    report = build_report(record)
    assert report.unrejoined == [1]
    assert "Not rejoined by the end: learners [1]" in render_markdown(report)


def test_a_kill_during_the_comeback_is_shown_as_killed_again(tmp_path: Path) -> None:
    record = synthetic_record(tmp_path)
    record.kills = [
        KillRecord(1, 40.0, 120, restarted_at_s=50.0, killed_again_at_s=52.0),
        KillRecord(1, 52.0, 120, restarted_at_s=62.0, rejoined_at_s=70.0),
    ]
    report = build_report(record)
    assert report.unrejoined == []
    text = render_markdown(report)
    assert "| 1 | 40.0 s | 120 | 50.0 | killed again at 52.0 s |" in text
    assert "| 1 | 52.0 s | 120 | 62.0 | 70.0 |" in text


def test_markdown_summarises_goodput_bytes_loss_and_chaos(tmp_path: Path) -> None:
    text = render_markdown(build_report(synthetic_record(tmp_path)))
    assert "**84.5%**" in text
    assert (
        "start-up (each learner's first launch to its first step, failures during it included): 10.0 s"
        in text
    )
    assert "steady state (everything after it): **88.9%** = useful 169.0 s / 190.0 s" in text
    assert "5.0 s on average at start (2 launches), 5.0 s on restarts (1)" in text
    assert "first: 5.5000, final: 2.5000" in text
    assert "| learners → synchronizer | 53.7 KiB | 40.0x | 43.0 KiB | 50.0x |" in text
    assert "| synchronizer → learners | 537.1 KiB | 4.0x | 390.6 KiB | 5.5x |" in text
    assert "Every killed learner rejoined." in text
    assert "| learner-1 | 1.18 | 250 |" in text


def test_written_report_has_json_markdown_and_plot(tmp_path: Path) -> None:
    record = synthetic_record(tmp_path)
    report, markdown = write_report(record, tmp_path)
    assert (tmp_path / "report.md").read_text() == markdown
    assert "![loss](loss.png)" in markdown
    png = (tmp_path / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["summary"]["goodput"]["goodput"] == pytest.approx(report.goodput.goodput)
    again = RunRecord.from_dict(data["record"])
    assert build_report(again).goodput == report.goodput
    assert again.kills == record.kills
    assert again.losses == record.losses


def test_no_losses_means_no_plot_and_unknown_trend(tmp_path: Path) -> None:
    record = synthetic_record(tmp_path)
    record.losses = []
    report, markdown = write_report(record, tmp_path)
    assert report.loss_went_down is None
    assert not (tmp_path / "loss.png").exists()
    assert "first: n/a" in markdown
