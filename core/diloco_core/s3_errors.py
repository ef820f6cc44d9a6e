"""What an S3 failure means for its caller: the object is not there, the service cannot answer now
(retry), or anything else (a misconfiguration that retrying will not fix). ``storage.S3Store``
raises the matching ``StorageError``."""

from __future__ import annotations

from typing import Any, Literal

from diloco_core.s3_transfer import TransferError

Kind = Literal["not_found", "unavailable", "error"]

_RETRYABLE_CODES = ("PreconditionFailed", "SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout")


def code(exc: Exception) -> str:
    response: Any = getattr(exc, "response", None) or {}
    return str(response.get("Error", {}).get("Code", ""))


def status(exc: Exception) -> int:
    response: Any = getattr(exc, "response", None) or {}
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def failure(exc: Exception, what: str, bucket: str) -> tuple[Kind, str]:
    """The kind of a boto3 (or transfer) failure of ``what`` in ``bucket``, and its message."""
    from botocore.exceptions import ClientError

    if isinstance(exc, ClientError):
        c, s = code(exc), status(exc)
        if c in ("NoSuchKey", "404", "NotFound"):
            return "not_found", what
        if s >= 500 or c in _RETRYABLE_CODES:
            return "unavailable", f"{what}: {c or s}"
        return "error", f"{what}: {c} (HTTP {s}) in bucket {bucket!r}"
    if isinstance(exc, _transport_errors()):
        return "unavailable", f"{what}: {exc}"
    return "error", f"{what}: {exc} (bucket {bucket!r})"


def _transport_errors() -> tuple[type[Exception], ...]:
    """The client's failures to reach the service or to carry a request and its answer whole (a
    connection refused, reset or timed out, a body cut short or garbled on the way): the service may
    answer later. The rest of botocore's own (no credentials, an invalid parameter, a bad
    configuration) fail the same way every time."""
    from botocore import exceptions as e

    return (
        e.ConnectionError,  # EndpointConnectionError, ConnectTimeoutError, ProxyConnectionError, SSLError
        e.HTTPClientError,  # ConnectionClosedError, ReadTimeoutError, ResponseStreamingError
        e.IncompleteReadError,
        e.ChecksumError,
        e.FlexibleChecksumError,
        e.CapacityNotAvailableError,  # the client's own retry quota spent on failures like these
        TransferError,
    )
