"""Authentication of learner calls: a bearer token bound to the learner id named in the request.

401: no token, no learner header, or a token that belongs to nobody we know.
403: a valid token of another registered learner (a learner speaking for someone else), or a call
about another learner than the one authenticated.

``AuthenticateFirst`` authenticates every learner route before anything else about the request is
read or checked, so a caller without a valid token learns nothing (401), whatever its body.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from diloco_core.auth import verify_learner_token
from diloco_core.protocol import LEARNER_HEADER
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import ApiError

AUTHENTICATED_LEARNER = "diloco_learner"  # key of the authenticated learner id in the request's state

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def authenticate(
    job_secret: str,
    authorization: str | None,
    claimed: str | None,
    *,
    subject: str | None = None,
    known_learners: Iterable[str] = (),
) -> str:
    """The authenticated learner id, or an ``ApiError`` (401/403).

    ``claimed`` is the ``X-DiLoCo-Learner`` header; ``subject`` the learner the call is about (path or
    body), which must be the same learner.
    """
    token = bearer_token(authorization)
    if token is None:
        raise ApiError(401, "unauthenticated", "missing 'Authorization: Bearer <token>'", headers=_CHALLENGE)
    if not claimed:
        raise ApiError(401, "unauthenticated", "missing X-DiLoCo-Learner header", headers=_CHALLENGE)
    if not verify_learner_token(job_secret, claimed, token):
        for other in known_learners:
            if other != claimed and verify_learner_token(job_secret, other, token):
                raise ApiError(403, "forbidden", f"the token belongs to another learner, not to {claimed!r}")
        raise ApiError(401, "unauthenticated", f"invalid token for learner {claimed!r}", headers=_CHALLENGE)
    if subject is not None and subject != claimed:
        raise ApiError(403, "forbidden", f"learner {claimed!r} may not act for learner {subject!r}")
    return claimed


def same_learner(authenticated: str, subject: str) -> None:
    """403 unless the call is about the learner that made it (the path's or the body's learner)."""
    if subject != authenticated:
        raise ApiError(403, "forbidden", f"learner {authenticated!r} may not act for learner {subject!r}")


def authenticated_or_none(
    job_secret: str, headers: Headers, known_learners: Iterable[str] = ()
) -> str | None:
    """The learner the request's headers authenticate, or None (for routes that answer everyone,
    and tell a learner more)."""
    try:
        return authenticate(
            job_secret,
            headers.get("authorization"),
            headers.get(LEARNER_HEADER),
            known_learners=known_learners,
        )
    except ApiError:
        return None


class AuthenticateFirst:
    """ASGI middleware: on every path ``protects`` names, answer 401/403 (the protocol's error body)
    unless the headers authenticate a learner, before the body is read or anything is validated;
    the learner's id is left in the request's state under ``AUTHENTICATED_LEARNER``."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        job_secret: str,
        known_learners: Callable[[], Iterable[str]],
        protects: Callable[[str], bool],
    ) -> None:
        self.app = app
        self.job_secret = job_secret
        self.known_learners = known_learners
        self.protects = protects

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.protects(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            learner = authenticate(
                self.job_secret,
                headers.get("authorization"),
                headers.get(LEARNER_HEADER),
                known_learners=self.known_learners(),
            )
        except ApiError as exc:
            refusal = JSONResponse(exc.body.model_dump(), status_code=exc.status, headers=exc.headers)
            await refusal(scope, receive, send)
            return
        scope.setdefault("state", {})[AUTHENTICATED_LEARNER] = learner
        await self.app(scope, receive, send)
