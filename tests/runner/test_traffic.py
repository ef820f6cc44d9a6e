import pytest

from diloco.runner.traffic import Traffic, data_parallel_bytes, human_bytes


def test_data_parallel_bytes_is_params_times_bf16_times_two_times_steps() -> None:
    assert data_parallel_bytes(1000, 10) == 1000 * 2 * 2 * 10
    assert data_parallel_bytes(0, 10) == 0
    with pytest.raises(ValueError, match=">= 0"):
        data_parallel_bytes(-1, 1)


def test_reductions_each_way_at_the_socket_and_of_the_payload() -> None:
    t = Traffic(
        num_params=1_000_000, total_learner_steps=400, sent_bytes=16_000_000, received_bytes=64_000_000,
        wire_sent=20_000_000, wire_received=80_000_000,
    )  # fmt: skip
    assert t.data_parallel_bytes == 1_600_000_000
    assert (t.reduction_up, t.reduction_down) == (pytest.approx(80.0), pytest.approx(20.0))
    assert (t.payload_reduction_up, t.payload_reduction_down) == (pytest.approx(100.0), pytest.approx(25.0))
    assert Traffic(10, 1, 0, 0).reduction_up is None
    assert t.to_dict()["reduction_down"] == pytest.approx(20.0)


def test_human_bytes() -> None:
    assert human_bytes(512) == "512 B"
    assert human_bytes(2048) == "2.0 KiB"
    assert human_bytes(3 * 1024**3) == "3.0 GiB"
