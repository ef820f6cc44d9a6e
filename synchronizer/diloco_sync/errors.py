"""The one exception type the services raise for a request that cannot be served, and its response."""

from __future__ import annotations

from diloco_core.flags import describe_errors
from diloco_core.protocol import ErrorBody
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


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


async def api_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body.model_dump(), status_code=exc.status, headers=exc.headers)


async def validation_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    """Malformed parameters or JSON bodies: 400 ``bad_request`` with what was wrong (not FastAPI's 422)."""
    assert isinstance(exc, RequestValidationError)
    body = ErrorBody(code="bad_request", reason=describe_errors(exc.errors()) or "invalid request")
    return JSONResponse(body.model_dump(), status_code=400)


def error_responses(*statuses: int) -> dict[int | str, dict[str, object]]:
    """OpenAPI ``responses=`` entries documenting ErrorBody for the given statuses."""
    return {status: {"model": ErrorBody} for status in statuses}
