"""Event files written by ``diloco_core.tfevents`` read back by TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

import pytest
from diloco_core.tfevents import crc32c, file_name, scalars_event, version_event

from tests.support.tensorboard_files import read_scalars


def test_crc32c_matches_the_castagnoli_check_value() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value of CRC-32C
    assert crc32c(b"") == 0


def test_tensorboard_reads_back_every_scalar_with_its_step(tmp_path: Path) -> None:
    path = tmp_path / file_name(1_700_000_000.0)
    path.write_bytes(
        version_event(1_700_000_000.0)
        + scalars_event(1_700_000_001.0, 1, {"loss": 5.5, "lr": 1e-3})
        + scalars_event(1_700_000_002.0, 2, {"loss": 4.25, "fragment_0/merged_tokens": 2048.0})
        + scalars_event(1_700_000_003.0, 3_000_000_000, {"loss": 3.0})  # a step beyond 32 bits
    )
    scalars = read_scalars(tmp_path)
    assert scalars["loss"] == [(1, 5.5), (2, 4.25), (3_000_000_000, 3.0)]
    assert scalars["lr"] == [(1, pytest.approx(1e-3))]
    assert scalars["fragment_0/merged_tokens"] == [(2, 2048.0)]


def test_values_that_are_not_finite_are_left_out(tmp_path: Path) -> None:
    path = tmp_path / file_name(1.0)
    path.write_bytes(version_event(1.0) + scalars_event(2.0, 7, {"loss": float("nan"), "lr": 0.5}))
    assert read_scalars(tmp_path) == {"lr": [(7, 0.5)]}


def test_a_corrupted_record_is_detected_by_the_reader(tmp_path: Path) -> None:
    data = bytearray(version_event(1.0) + scalars_event(2.0, 1, {"loss": 1.0}))
    data[-6] ^= 0xFF  # a byte of the last record's data: its CRC no longer matches
    (tmp_path / file_name(1.0)).write_bytes(bytes(data))
    assert "loss" not in read_scalars(tmp_path)
