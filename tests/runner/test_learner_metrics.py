"""Final per-learner counts from the metrics files the learners write (pure parts and a real file)."""

import json
from pathlib import Path

import pytest

from diloco.runner.learner_metrics import counts_from_records, parse_records, read_counts, read_processes
from diloco.runner.slots import learner_label, resumed_step


def _line(pid: int, step: int, tokens: int, sent: int) -> str:
    return json.dumps({"pid": pid, "step": step, "tokens": tokens, "bytes_sent": sent, "loss": 3.0})


def test_a_restarted_learner_ends_at_its_last_record_and_its_bytes_add_up(tmp_path: Path) -> None:
    lines = [
        _line(11, 5, 2560, 0), _line(11, 10, 5120, 4000), _line(11, 15, 7680, 9000),
        '{"pid": 11, "step": 1',  # the process was SIGKILLed in the middle of a line
        _line(12, 10, 5120, 0), _line(12, 15, 7680, 3000), _line(12, 23, 11776, 7000),
    ]  # fmt: skip
    path = tmp_path / "learner-0.jsonl"
    path.write_text("\n".join(lines) + "\n")
    counts = read_counts(path)
    assert counts is not None
    assert (counts.step, counts.tokens, counts.processes) == (23, 11776, 2)
    assert counts.bytes_sent == 9000 + 7000


def test_missing_or_empty_metrics_give_none(tmp_path: Path) -> None:
    assert read_counts(tmp_path / "nowhere.jsonl") is None
    (tmp_path / "empty.jsonl").write_text("\n")
    assert read_counts(tmp_path / "empty.jsonl") is None


def test_records_without_a_step_or_not_objects_are_ignored() -> None:
    records = parse_records(['{"note": "x"}', "[1, 2]", _line(1, 4, 10, 0)])
    assert [r["step"] for r in records] == [4]
    counts = counts_from_records(records)
    assert counts is not None
    assert counts.bytes_sent == 0


def test_ddp_notes_name_the_rank_of_the_unit() -> None:
    assert learner_label("ddp", 2, "learner-0") == "rank 2 of learner-0"
    assert learner_label("decoupled", 2, "learner-2") == "learner-2 (learner 2)"


def test_the_step_a_restarted_learner_resumed_from_is_read_from_its_newest_launch() -> None:
    first = "\n=== 10:00:00 launch: python -m diloco_worker\nINFO step=5 loss=3.1\n"
    second = (
        "\n=== 10:01:00 launch: python -m diloco_worker\nINFO learner=l step=40 resumed from checkpoint\n"
    )
    third = "\n=== 10:02:00 launch: python -m diloco_worker\nINFO step=1 loss=5.0\n"
    assert resumed_step("") is None
    assert resumed_step(first) == 0  # no checkpoint: started from scratch
    assert resumed_step(first + second + "INFO step=45 loss=2.9\n") == 40
    assert resumed_step(first + second + third) == 0  # the newest process had no checkpoint


def test_the_records_of_one_process_only(tmp_path: Path) -> None:
    path = tmp_path / "learner-1.jsonl"
    path.write_text("\n".join([_line(7, 30, 1, 10), _line(8, 20, 1, 5), _line(8, 25, 1, 6)]) + "\n")
    newest = read_counts(path, pids={8})
    assert newest is not None
    assert (newest.step, newest.bytes_sent) == (25, 6)
    assert read_counts(path, pids={9}) is None  # a process that has written nothing yet


def test_each_process_reports_its_first_step_and_the_blocked_time_it_added(tmp_path: Path) -> None:
    path = tmp_path / "learner-0.jsonl"
    first = {"pid": 7, "step": 1, "blocked_s": 0.1, "resumed_blocked_s": 0.0, "first_step_at": 100.0}
    again = {"pid": 8, "step": 31, "blocked_s": 4.2, "resumed_blocked_s": 4.0, "first_step_at": 150.5}
    lines = [
        first,
        {"pid": 7, "step": 2, "blocked_s": 4.5},
        again,
        {"pid": 8, "step": 32, "blocked_s": 5.5},
        {"pid": 9, "step": 33, "blocked_s": 9.0},
    ]  # fmt: skip  (pid 9: no start-up record)
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    facts = read_processes(path)
    assert set(facts) == {7, 8}
    assert (facts[7].first_step_at, facts[7].blocked_s) == (100.0, pytest.approx(4.5))
    assert (facts[8].first_step_at, facts[8].blocked_s) == (150.5, pytest.approx(1.5))
    assert read_processes(tmp_path / "nowhere.jsonl") == {}
