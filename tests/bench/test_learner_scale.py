"""`diloco bench learner-scale`: the measured window of a learner's metrics, the model's size, the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from diloco_bench import learner_scale


def rec(step: int, time: float, blocked: float) -> dict[str, float]:
    return {"step": step, "time": time, "blocked_s": blocked}


def test_the_window_starts_at_the_first_logged_step_after_the_warm_up() -> None:
    records = [rec(4, 1.0, 0.5), rec(8, 3.0, 0.6), {"step": 10, "time": 3.5}, rec(12, 5.0, 0.7),
               rec(16, 7.0, 0.9)]  # fmt: skip
    w = learner_scale.window(records, warmup=8, fragments=4, inner_steps=16)
    assert (w.steps, w.start, w.end, w.seconds) == (8, 3.0, 7.0, 4.0)
    assert w.blocked_s == pytest.approx(0.3)
    assert w.fragment_syncs == 2.0  # each of 4 fragments falls due once every 16 steps
    assert w.step_s == 0.5
    assert w.blocked_ms_per_sync == pytest.approx(150.0)
    assert w.blocked_fraction == pytest.approx(0.075)


def test_a_window_of_fewer_than_two_logged_steps_is_refused() -> None:
    with pytest.raises(ValueError, match="fewer than two"):
        learner_scale.window([rec(4, 1.0, 0.1), rec(8, 2.0, 0.2)], warmup=6, fragments=4, inner_steps=16)


def test_the_shapes_are_the_sizes_they_are_named_after() -> None:
    for name, (n_layer, n_head, n_embd) in learner_scale.SHAPES.items():
        assert n_embd % n_head == 0
        count = learner_scale.parameters(n_layer, n_head, n_embd, block_size=64)
        named = float(name.removesuffix("M")) * 1e6
        assert 0.85 * named < count < 1.15 * named, (name, count)


def test_the_table_shows_memory_against_the_fp32_model_and_cost_per_million_fragment_parameters() -> None:
    row = {"params": 20e6, "fragment_params": 5e6, "step_s": 0.25, "blocked_ms_per_sync": 10.0, "blocked_ms_per_m": 2.0,
           "blocked_fraction": 0.01, "learner_peak_rss": 8e8, "learner_rss_after_warmup": 4e8,
           "learner_rss_at_end": None, "sync_peak_rss": None, "wire_sent": 8e7,
           "wire_received": 4e6}  # fmt: skip
    line = learner_scale.table({"20M": row}).splitlines()[-1].split()
    assert line[:5] == ["20M", "20.0M", "0.250", "10.0", "2.00"]  # 10 ms over a 5 M-parameter fragment
    assert line[5:10] == ["1.00", "0.80", "10.0", "5.0", "-"]  # 0.8 GB is 10x the 80 MB of fp32
    assert line[10:] == ["nan", "nan", "80.0", "4.0"]  # a synchronizer peak that could not be read


def test_the_memory_at_a_moment_is_the_sample_nearest_to_it() -> None:
    samples = [(10.0, 1), (10.5, 2), (11.0, 3)]
    assert [learner_scale.rss_at(samples, t) for t in (0.0, 10.4, 10.8, 99.0)] == [1, 2, 3, 3]
    assert learner_scale.rss_at([], 10.0) is None


def test_too_few_steps_after_the_warm_up_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        learner_scale.parse_args(["--steps", "10", "--warmup", "8"])
    assert "--steps" in capsys.readouterr().err


@pytest.mark.integration
def test_a_learner_trains_against_a_real_synchronizer_and_is_measured(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    argv = ["--sizes", "2M", "--steps", "16", "--warmup", "4", "--log-every", "4", "--threads", "1"]
    assert learner_scale.main([*argv, "--json", str(out)]) == 0
    r = json.loads(out.read_text())["sizes"]["2M"]
    assert r["steps"] == 12
    assert r["blocked_ms_per_sync"] > 0
    assert r["blocked_ms_per_m"] == pytest.approx(r["blocked_ms_per_sync"] / (r["fragment_params"] / 1e6))
    assert r["learner_peak_rss"] >= r["learner_rss_after_warmup"] > 4 * r["params"]  # it holds the model
    assert r["sync_peak_rss"] > 0
    assert r["wire_sent"] > r["params"]  # the initial parameters (fp32, compressed) went up first
    assert r["wire_received"] > 0
