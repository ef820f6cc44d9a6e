import pytest

from diloco.runner.traffic import Traffic, data_parallel_bytes, human_bytes


def test_data_parallel_bytes_is_params_times_fp32_times_two_times_steps() -> None:
    assert data_parallel_bytes(1000, 10) == 1000 * 4 * 2 * 10
    assert data_parallel_bytes(0, 10) == 0
    with pytest.raises(ValueError, match=">= 0"):
        data_parallel_bytes(-1, 1)


def test_reduction_compares_sent_bytes_with_data_parallel() -> None:
    t = Traffic(
        num_params=1_000_000, total_learner_steps=400, sent_bytes=32_000_000, received_bytes=64_000_000
    )
    assert t.data_parallel_bytes == 3_200_000_000
    assert t.reduction == pytest.approx(100.0)
    assert Traffic(10, 1, 0, 0).reduction is None
    assert t.to_dict()["reduction"] == pytest.approx(100.0)


def test_human_bytes() -> None:
    assert human_bytes(512) == "512 B"
    assert human_bytes(2048) == "2.0 KiB"
    assert human_bytes(3 * 1024**3) == "3.0 GiB"
