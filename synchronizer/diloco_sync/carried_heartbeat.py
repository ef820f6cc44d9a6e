"""A heartbeat carried by a request the learner sends anyway (a contribution, a long-poll), in the
``X-DiLoCo-Heartbeat`` header: recorded as a heartbeat request would be, so a busy learner needs no
separate heartbeat request and its connection carries one request head less every interval."""

from __future__ import annotations

from collections.abc import Callable

import pydantic
from diloco_core.protocol import HEARTBEAT_HEADER, HEARTBEAT_RECORDED_HEADER, Heartbeat
from diloco_core.validation_errors import describe_errors

from .errors import ApiError

MAX_HEADER_CHARS = 8192  # a heartbeat with a few hundred fragments' counters; the header is refused above


def carried_heartbeat(raw: str | None) -> Heartbeat | None:
    """The heartbeat a request carries (None: none); ``ApiError`` 400 for one that does not parse or
    is out of bounds, as the heartbeat request's body would be refused."""
    if raw is None:
        return None
    if len(raw) > MAX_HEADER_CHARS:
        raise ApiError(400, "bad_request", f"{HEARTBEAT_HEADER} is longer than {MAX_HEADER_CHARS} characters")
    try:
        return Heartbeat.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        raise ApiError(400, "bad_request", f"{HEARTBEAT_HEADER}: {describe_errors(exc.errors())}") from None


def record_carried(
    raw: str | None, learner_id: str, record: Callable[[str, Heartbeat], object], headers: dict[str, str]
) -> None:
    """Record the heartbeat the request carries, if any, and say so in the answer's ``headers``.
    A learner the synchronizer does not know, or that left, gets no mark: its own heartbeat request,
    sent when nothing carried one for an interval, hears why (404 or 409) and registers again."""
    hb = carried_heartbeat(raw)
    if hb is None:
        return
    try:
        record(learner_id, hb)
    except ApiError as exc:
        if exc.status in (404, 409):
            return
        raise
    headers[HEARTBEAT_RECORDED_HEADER] = "1"
