"""The one exception type the services raise for a request that cannot be served, and its response."""

from __future__ import annotations

from diloco_core.protocol import ErrorBody
from diloco_core.validation_errors import describe_errors
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

# codes of the refusals the framework makes itself (no route, wrong method, an unreadable body)
_HTTP_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "oversized"}


class ApiError(Exception):
    """A request refused with an HTTP status, a stable ``code`` a client can act on and a reason."""

    def __init__(
        self,
        status: int,
        code: str,
        reason: str,
        *,
        retryable: bool = False,
        current_version: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(f"{status} {code}: {reason}")
        self.status = status
        self.body = ErrorBody(code=code, reason=reason, retryable=retryable, current_version=current_version)
        self.headers = headers

    @property
    def code(self) -> str:
        return self.body.code


def not_registered(learner_id: str) -> ApiError:
    """404 ``not_registered``: the synchronizer does not know the learner (never registered, or its
    registry was lost); a learner answers it by registering again."""
    return ApiError(404, "not_registered", f"learner {learner_id} is not registered: register again")


def body_not_written(exc: OSError) -> ApiError:
    """503 ``storage_unavailable`` (retryable): a request body could not be written where it goes."""
    return ApiError(503, "storage_unavailable", f"the body could not be written: {exc}", retryable=True)


def learner_left(learner_id: str) -> ApiError:
    """409 ``left``: the learner called leave; it may come back by registering again."""
    return ApiError(
        409, "left", f"learner {learner_id} has left the job: register again to rejoin before contributing"
    )


async def api_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body.model_dump(), status_code=exc.status, headers=exc.headers)


async def validation_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    """Malformed parameters or JSON bodies: 400 ``bad_request`` with what was wrong (not FastAPI's 422)."""
    assert isinstance(exc, RequestValidationError)
    body = ErrorBody(code="bad_request", reason=describe_errors(exc.errors()) or "invalid request")
    return JSONResponse(body.model_dump(), status_code=400)


async def http_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    """The framework's own refusals (unknown route, wrong method, a body that is not UTF-8 JSON or
    nests too deep to parse) in the protocol's error body, not the framework's ``{"detail": ...}``."""
    assert isinstance(exc, HTTPException)
    reason = str(exc.detail)
    if exc.status_code == 400 and "parsing the body" in reason:
        reason = "the body is not JSON that can be parsed: invalid UTF-8, or nested too deep"
    body = ErrorBody(code=_HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}"), reason=reason)
    return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=exc.headers)


def error_responses(*statuses: int) -> dict[int | str, dict[str, object]]:
    """OpenAPI ``responses=`` entries documenting ErrorBody for the given statuses."""
    return {status: {"model": ErrorBody} for status in statuses}
