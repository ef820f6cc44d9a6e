"""The one rendering of validation errors (pydantic's and FastAPI's ``errors()``) as text: settings,
the operator's spec and the synchronizer's 400 answers all describe what is wrong with it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any


def dotted(loc: Sequence[Any]) -> str:
    """A location as ``a.b.0`` (empty for the whole object)."""
    return ".".join(str(p) for p in loc)


def describe_errors(
    errors: Iterable[Mapping[str, Any]], where: Callable[[tuple[Any, ...]], str] = dotted
) -> str:
    """``where: message; where: message`` — the one rendering of validation errors (pydantic's and
    FastAPI's ``errors()``); ``where(loc)`` names the place (empty: the message alone). Never shows
    the offending input, which may be a secret."""
    parts = []
    for e in errors:
        message = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        place = where(tuple(e.get("loc", ())))
        parts.append(f"{place}: {message}" if place else message)
    return "; ".join(parts)
