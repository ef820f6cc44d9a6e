"""Kubernetes resource quantities (``500m``, ``2``, ``16Gi``, ``1e9``): the syntax the CRD admits and
their value, written once for the spec's checks and the budgets computed from them."""

from __future__ import annotations

import re
from decimal import ROUND_CEILING, Decimal
from typing import Any

# A resource quantity as the CRD admits it: Kubernetes' own quantity syntax, without a sign (a
# negative request or limit can never work).
QUANTITY_PATTERN = r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
_QUANTITY = re.compile(QUANTITY_PATTERN)
_EXPONENT = re.compile(r"[eE][+-]?[0-9.]")  # 1e9, 1E3 (a bare trailing E is the exa suffix)
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
            "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12),
            "P": Decimal(10**15), "E": Decimal(10**18)}  # fmt: skip


def is_quantity(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return value >= 0
    return isinstance(value, str) and _QUANTITY.match(value) is not None


def quantity_bytes(value: int | str) -> int:
    """A quantity as a whole number (of bytes, for a memory quantity), rounded up as Kubernetes does."""
    if not is_quantity(value):
        raise ValueError(f"{value!r} is not a quantity (e.g. 512Mi, 4Gi, 1e9)")
    if isinstance(value, int):
        return value
    text = value.lstrip("+")
    suffix = text[-2:] if text[-2:] in _BINARY else ""
    if suffix:
        number = Decimal(text[:-2]) * _BINARY[suffix]
    elif _EXPONENT.search(text):
        number = Decimal(text)
    else:
        unit = text[-1] if text[-1] in _DECIMAL else ""
        number = Decimal(text[: len(text) - len(unit)]) * _DECIMAL[unit]
    return int(number.to_integral_value(rounding=ROUND_CEILING))
