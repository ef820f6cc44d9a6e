"""Kubernetes quantities read as numbers, as the kubelet reads a pod's memory limit."""

from __future__ import annotations

import pytest
from diloco_operator.schema.quantity import is_quantity, quantity_bytes


@pytest.mark.parametrize(
    ("value", "number"),
    [
        ("4Gi", 4 * 2**30),
        ("512Mi", 512 * 2**20),
        ("0.5Gi", 2**29),
        ("+3Ki", 3072),
        ("1e9", 10**9),
        ("1E3", 1000),  # an exponent
        ("2E", 2 * 10**18),  # a bare E is exa
        ("1.5G", 1_500_000_000),
        ("100m", 1),  # a thousandth of a byte rounds up to one, as Kubernetes rounds
        ("7", 7),
        (8, 8),
        (0, 0),
    ],
)
def test_a_quantity_is_read_as_kubernetes_reads_it(value: int | str, number: int) -> None:
    assert is_quantity(value)
    assert quantity_bytes(value) == number


@pytest.mark.parametrize("value", ["lots", "-1", "2 Gi", "1Gb", "", -5, True])
def test_what_is_not_a_quantity_is_refused_by_name(value: object) -> None:
    assert not is_quantity(value)
    with pytest.raises(ValueError, match="is not a quantity"):
        quantity_bytes(value)  # type: ignore[arg-type]
