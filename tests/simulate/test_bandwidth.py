"""WAN bandwidth estimates against their definitions."""

from __future__ import annotations

import pytest

from diloco.simulate.bandwidth import LinkSettings, estimate_bandwidth


def test_data_parallel_sends_the_full_gradient_every_step() -> None:
    link = LinkSettings(params=12e9, step_time_s=1.0, bytes_per_value=2.0)
    dp = estimate_bandwidth(link)[0]
    assert dp.method == "data-parallel"
    assert dp.mean_gbps == pytest.approx(192.0)
    assert dp.peak_gbps == dp.mean_gbps
    assert dp.bytes_per_step == pytest.approx(24e9)


def test_decoupled_mean_is_h_times_bits_lower_and_peak_p_times_lower_than_diloco() -> None:
    link = LinkSettings(
        params=1e9,
        step_time_s=0.5,
        bytes_per_value=4.0,
        inner_steps=64,
        fragments=8,
        overlap=2,
        quantizer_bits=4.0,
    )
    dp, diloco, decoupled = estimate_bandwidth(link)
    assert dp.mean_gbps / decoupled.mean_gbps == pytest.approx(64 * 32 / 4)
    assert diloco.mean_gbps == pytest.approx(decoupled.mean_gbps)
    assert diloco.peak_gbps / decoupled.peak_gbps == pytest.approx(8)
    # One 1/8 fragment of 4-bit values within tau = 2 steps of 0.5 s.
    assert decoupled.peak_gbps == pytest.approx(1e9 / 8 * 4 / 1.0 / 1e9)


def test_one_fragment_gives_one_outer_row() -> None:
    methods = [b.method for b in estimate_bandwidth(LinkSettings(fragments=1))]
    assert methods == ["data-parallel", "DiLoCo (P=1)"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"params": 0.0},
        {"step_time_s": -1.0},
        {"fragments": 200},
        {"overlap": 0},
        {"overlap": 50},
        {"quantizer_bits": 0.0},
    ],
)
def test_bad_link_settings_are_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="invalid"):
        LinkSettings(**kwargs)  # type: ignore[arg-type]
