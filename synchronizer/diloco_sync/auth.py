"""Authentication of learner calls: a bearer token bound to the learner id named in the request.

401: no token, no learner header, or a token that belongs to nobody we know.
403: a valid token of another registered learner (a learner speaking for someone else).
"""

from __future__ import annotations

from collections.abc import Iterable

from diloco_core.auth import verify_learner_token

from .errors import ApiError

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
