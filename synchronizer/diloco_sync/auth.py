"""Authentication of learner calls: a signed bearer token (``diloco_core.auth``) bound to the learner
id named in the request, unexpired and not revoked.

401: no token, no learner header, a token not signed with the job secret, expired or revoked.
403: a valid token of another learner (a learner speaking for someone else), or a call about
another learner than the one authenticated.

``AuthenticateFirst`` authenticates every learner route before anything else about the request is
read or checked, so a caller without a valid token learns nothing (401), whatever its body.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from diloco_core.auth import TokenClaims, read_learner_token, token_problem
from diloco_core.protocol import LEARNER_HEADER
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import ApiError

AUTHENTICATED_LEARNER = "diloco_learner"  # key of the authenticated learner id in the request's state
TOKEN_CLAIMS = "diloco_claims"  # noqa: S105 (key of its token's claims in the state)

_CHALLENGE = {"WWW-Authenticate": "Bearer"}


def _no_revocations(_learner: str) -> int:
    return 0


@dataclass(frozen=True)
class TokenCheck:
    """What a token is checked against: the job secret, the lowest generation accepted per learner
    (the revocations), and the clock."""

    job_secret: str
    min_generation: Callable[[str], int] = _no_revocations
    clock: Callable[[], float] = field(default=time.time)


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def authenticate(
    check: TokenCheck, authorization: str | None, claimed: str | None, *, subject: str | None = None
) -> TokenClaims:
    """The claims of the authenticated learner's token, or an ``ApiError`` (401/403).

    ``claimed`` is the ``X-DiLoCo-Learner`` header; ``subject`` the learner the call is about (path or
    body), which must be the same learner.
    """
    token = bearer_token(authorization)
    if token is None:
        raise ApiError(401, "unauthenticated", "missing 'Authorization: Bearer <token>'", headers=_CHALLENGE)
    if not claimed:
        raise ApiError(401, "unauthenticated", "missing X-DiLoCo-Learner header", headers=_CHALLENGE)
    claims = read_learner_token(check.job_secret, token)
    if claims is None:
        raise ApiError(401, "unauthenticated", f"invalid token for learner {claimed!r}", headers=_CHALLENGE)
    if claims.learner != claimed:
        raise ApiError(403, "forbidden", f"the token belongs to another learner, not to {claimed!r}")
    problem = token_problem(claims, claimed, check.clock(), check.min_generation(claimed))
    if problem is not None:
        raise ApiError(401, "unauthenticated", problem, headers=_CHALLENGE)
    if subject is not None and subject != claimed:
        raise ApiError(403, "forbidden", f"learner {claimed!r} may not act for learner {subject!r}")
    return claims


def declared_problem(claims: TokenClaims, steps: int, tokens: int) -> str | None:
    """Why a contribution's tokens are more than its learner's token declares per step, or None.
    A part within the bound keeps any sum of parts within it, so continuations need no other check.
    Fewer is allowed: a padded or packed batch counts fewer tokens than its shape."""
    tps = claims.tokens_per_step
    if tps is None or tokens <= steps * tps:
        return None
    return (
        f"{tokens} tokens in {steps} steps is more than the {tps} tokens per step learner "
        f"{claims.learner!r} is declared to train on (its unit's batch x context x accumulation x pods)"
    )


def same_learner(authenticated: str, subject: str) -> None:
    """403 unless the call is about the learner that made it (the path's or the body's learner)."""
    if subject != authenticated:
        raise ApiError(403, "forbidden", f"learner {authenticated!r} may not act for learner {subject!r}")


def authenticated_or_none(check: TokenCheck, headers: Headers) -> str | None:
    """The learner the request's headers authenticate, or None (for routes that answer everyone,
    and tell a learner more)."""
    try:
        return authenticate(check, headers.get("authorization"), headers.get(LEARNER_HEADER)).learner
    except ApiError:
        return None


class AuthenticateFirst:
    """ASGI middleware: on every path ``protects`` names, answer 401/403 (the protocol's error body)
    unless the headers authenticate a learner, before the body is read or anything is validated;
    the learner's id is left in the request's state under ``AUTHENTICATED_LEARNER`` and its token's
    claims under ``TOKEN_CLAIMS``."""

    def __init__(self, app: ASGIApp, *, check: TokenCheck, protects: Callable[[str], bool]) -> None:
        self.app = app
        self.check = check
        self.protects = protects

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.protects(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        try:
            claims = authenticate(self.check, headers.get("authorization"), headers.get(LEARNER_HEADER))
        except ApiError as exc:
            refusal = JSONResponse(exc.body.model_dump(), status_code=exc.status, headers=exc.headers)
            await refusal(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state[AUTHENTICATED_LEARNER] = claims.learner
        state[TOKEN_CLAIMS] = claims
        await self.app(scope, receive, send)
