"""The largest numbers a learner may report: far beyond any real training run, yet small enough that
no arithmetic on them can overflow.

A learner reports counters (steps, tokens, versions, sequence numbers, bytes) and durations. The
synchronizer refuses any value outside these bounds (400 ``bad_request``), so what it accepts is
physically possible, and every quantity computed from it stays a finite float64:

- a contribution's weight ``tokens * tokens / steps`` is at most ``MAX_TOKENS_PER_STEP * tokens``
  (as ``tokens <= steps * MAX_TOKENS_PER_STEP``), that is at most 1e9 x 1e17 = 1e26, and a round's
  weights are normalised by their largest before they are summed (``merge``), so no sum overflows;
- a reported step time is at most a day, and the grace window is capped in seconds whatever the
  learners report (``rounds.grace_cap``).

The pydantic types below carry these bounds into the API models (``protocol``) and so into the
OpenAPI document.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, WithJsonSchema

MAX_STEPS = 10**12  # one inner step per millisecond for 30 years is 9.5e11
MAX_TOKENS = 10**17  # tokens a learner reports; the largest public pre-training runs use ~4e13
MAX_TOKENS_PER_STEP = 10**9  # one learner's batch; the largest published global batches are ~6e7 tokens
MAX_VERSION = 10**12  # a fragment version per millisecond for 30 years
MAX_SEQ = 10**12  # a learner's contribution sequence number (one per contribution)
MAX_FRAGMENTS = 100_000  # fragment indices are below this (a plan has a handful to a few hundred)
MAX_STEP_TIME_S = 86_400.0  # a reported inner step time: one day
MAX_SECONDS = 10.0**10  # a reported cumulative duration (time blocked on communication): ~300 years
MAX_BYTES = 10**18  # bytes a learner reports having sent: an exabyte
MAX_LOSS = 10.0**6  # a reported held-out loss (cross-entropy of a 50k vocabulary at random is ~10.8)
MAX_WAIT_S = 3600.0  # a long-poll's requested wait (the synchronizer caps it lower still)

Steps = Annotated[int, Field(ge=0, le=MAX_STEPS)]
Tokens = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
Version = Annotated[int, Field(ge=0, le=MAX_VERSION)]
Seconds = Annotated[float, Field(ge=0.0, le=MAX_SECONDS, allow_inf_nan=False)]

_FRAGMENT_KEY = re.compile(r"0|[1-9][0-9]{0,4}")
FRAGMENT_KEY_PATTERN = f"^(?:{_FRAGMENT_KEY.pattern})$"


def parse_fragment_key(key: Any) -> int:
    """A fragment index used as a JSON object key: the decimal digits of 0..MAX_FRAGMENTS-1 exactly
    (no sign, no leading zero, no underscore, no space), as the OpenAPI document declares."""
    if isinstance(key, int) and not isinstance(key, bool):
        value = key
    elif isinstance(key, str) and _FRAGMENT_KEY.fullmatch(key):
        value = int(key)
    else:
        raise ValueError(f"a fragment index must be a decimal integer, got {key!r}")
    if not 0 <= value < MAX_FRAGMENTS:
        raise ValueError(f"fragment index {value} is not in [0, {MAX_FRAGMENTS})")
    return value


_KEY_SCHEMA = {"type": "string", "pattern": FRAGMENT_KEY_PATTERN}
FragmentKey = Annotated[int, BeforeValidator(parse_fragment_key), WithJsonSchema(_KEY_SCHEMA)]
"""A fragment index as a JSON object key (JSON keys are strings): ``parse_fragment_key`` takes
exactly the keys ``FRAGMENT_KEY_PATTERN`` describes."""


def _empty_map() -> dict[int, Any]:
    return {}


def fragment_map(description: str, *, required: bool = False) -> Any:
    """The ``Field`` of a map fragment index → value: its schema names the keys it takes
    (``propertyNames``) and no others, with at most one entry per possible fragment."""
    extra: dict[str, Any] = {"propertyNames": _KEY_SCHEMA, "additionalProperties": False}
    if required:
        return Field(..., max_length=MAX_FRAGMENTS, description=description, json_schema_extra=extra)
    return Field(
        default_factory=_empty_map, max_length=MAX_FRAGMENTS, description=description, json_schema_extra=extra
    )
