"""Validation of uploaded payloads (blocking: decompression and checks run in a worker thread).

Every refusal is an ``ApiError`` with the codec's reason code, so a learner knows what went wrong;
nothing here touches the service's state.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from diloco_core import codec
from diloco_core.fragments import Fragment
from diloco_core.merge import check_finite, non_finite_reason
from diloco_core.quantize import LOSSLESS, PLANES
from diloco_core.screening import tensors_norm

from .contribution import Arrays
from .errors import ApiError


def payload_limit(spec: Fragment, configured: int | None) -> int:
    """The largest payload taken for a fragment: the most a payload of it can be in any format
    (``codec.max_payload_size``), or ``configured`` when that is smaller."""
    bound = codec.max_payload_size(spec)
    return bound if configured is None else min(configured, bound)


@contextmanager
def _refusing_codec_errors() -> Iterator[None]:
    """A ``CodecError`` met inside, as the answer: 413 for an oversized payload, else 400, with the
    codec's code and reason (a payload's tensors are read, and topk's indices checked, after it is
    decoded)."""
    try:
        yield
    except codec.OversizedPayload as exc:
        raise ApiError(413, exc.code, str(exc)) from exc
    except codec.CodecError as exc:
        raise ApiError(400, exc.code, str(exc)) from exc


def _decode(blob: bytes | memoryview, spec: Fragment, max_bytes: int) -> codec.QuantizedPayload:
    with _refusing_codec_errors():
        return codec.decode_quantized(blob, fragment=spec, max_bytes=max_bytes)


@dataclass(frozen=True)
class Checked:
    """A contribution's outer gradient as checked on arrival: its tensors, still quantized until a
    round reads them, and its norm (``screening.tensors_norm``, measured in the same reading)."""

    tensors: codec.QuantizedArrays
    norm: float


def validate_outer_gradient(
    blob: bytes | memoryview, spec: Fragment, base_version: int, max_bytes: int
) -> Checked:
    """Check a contribution for fragment ``spec`` (every tensor read once: finite, and its norm); its
    header must agree with the query parameters."""
    payload = _decode(blob, spec, max_bytes)
    if payload.kind != "outer_grad":
        raise ApiError(400, "bad_request", f"payload kind is {payload.kind!r}, expected 'outer_grad'")
    if payload.fragment != spec.index:
        raise ApiError(
            400, "bad_request", f"payload is for fragment {payload.fragment}, sent to fragment {spec.index}"
        )
    if payload.base_version != base_version:
        raise ApiError(
            400,
            "bad_request",
            f"payload base version {payload.base_version} differs from base_version={base_version} of the request",
        )
    with _refusing_codec_errors():
        norm = tensors_norm(payload.tensors)  # inf exactly when a value is not finite
        reason = non_finite_reason(payload.tensors, norm)
    if reason is not None:
        raise ApiError(400, "non_finite", reason)
    return Checked(payload.tensors, norm)


def validate_initial_params(blob: bytes | memoryview, spec: Fragment, max_bytes: int) -> Arrays:
    """Decode the initial parameters of a fragment (kind "params", lossless: fp32, or fp32-planes)."""
    payload = _decode(blob, spec, max_bytes)
    if payload.kind != "params":
        raise ApiError(400, "bad_request", f"payload kind is {payload.kind!r}, expected 'params'")
    if payload.quantizer not in LOSSLESS:
        raise ApiError(
            400, "bad_request", f"initial parameters must be fp32 or {PLANES}, got {payload.quantizer!r}"
        )
    if payload.fragment != spec.index:
        raise ApiError(
            400, "bad_request", f"payload is for fragment {payload.fragment}, sent to fragment {spec.index}"
        )
    with _refusing_codec_errors():
        tensors = dict(payload.tensors)
    reason = check_finite(tensors)
    if reason is not None:
        raise ApiError(400, "non_finite", reason)
    return tensors
