"""What an S3 client's failure means for its caller: botocore's exceptions as the client raises them."""

from __future__ import annotations

import pytest
from botocore import exceptions as e
from diloco_core.s3_errors import failure
from diloco_core.s3_transfer import TransferError

_URL = "http://s3.example:8333/bucket/k"


@pytest.mark.parametrize(
    "exc",
    [
        e.EndpointConnectionError(endpoint_url=_URL),
        e.ConnectionClosedError(endpoint_url=_URL),
        e.ReadTimeoutError(endpoint_url=_URL),
        e.ConnectTimeoutError(endpoint_url=_URL),
        e.ProxyConnectionError(proxy_url="http://proxy:3128"),
        e.IncompleteReadError(actual_bytes=10, expected_bytes=100),
        e.ResponseStreamingError(error="connection reset"),
        e.FlexibleChecksumError(error_msg="checksum mismatch"),
        TransferError("a range came back short"),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_a_transport_failure_is_unavailable(exc: Exception) -> None:
    kind, message = failure(exc, "k", "bucket")
    assert kind == "unavailable"
    assert message.startswith("k: ")


@pytest.mark.parametrize(
    "exc",
    [
        e.NoCredentialsError(),
        e.PartialCredentialsError(provider="env", cred_var="AWS_SECRET_ACCESS_KEY"),
        e.ParamValidationError(report="Invalid bucket name"),
        e.NoRegionError(),
        e.InvalidS3AddressingStyleError(s3_addressing_style="sideways"),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_a_client_that_cannot_make_the_request_is_an_error_retrying_will_not_fix(exc: Exception) -> None:
    kind, message = failure(exc, "k", "bucket")
    assert kind == "error"
    assert str(exc) in message
    assert "'bucket'" in message


def _client_error(code: str, http: int) -> e.ClientError:
    response = {"Error": {"Code": code, "Message": ""}, "ResponseMetadata": {"HTTPStatusCode": http}}
    return e.ClientError(response, "GetObject")


@pytest.mark.parametrize(
    ("code", "http", "kind"),
    [
        ("NoSuchKey", 404, "not_found"),
        ("404", 404, "not_found"),
        ("SlowDown", 503, "unavailable"),
        ("InternalError", 500, "unavailable"),
        ("", 502, "unavailable"),
        ("AccessDenied", 403, "error"),
        ("SignatureDoesNotMatch", 403, "error"),
        ("NoSuchBucket", 404, "error"),
    ],
)
def test_a_service_answer_maps_by_its_code_and_status(code: str, http: int, kind: str) -> None:
    assert failure(_client_error(code, http), "k", "bucket")[0] == kind


def test_any_other_exception_is_an_error() -> None:
    assert failure(RuntimeError("boom"), "k", "bucket")[0] == "error"
