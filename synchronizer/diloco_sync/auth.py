"""Authentication of learner calls: each request signed with the learner's token for this process's
instance (``diloco_core.request_proof``), the token's claims naming the learner in the request,
unexpired and not revoked, and the request's proof used once.

401 (with the challenge naming this process's instance): no proof, a bearer token (the whole token on
the wire is refused: it would be good for any request until it expires), no learner header, a
signature that is not this request's for this instance under a token of the job, a time outside the
window (code ``clock_skew``, retryable: the learner's token is fine, a clock is not), a proof used
before, an expired or revoked token.
403: a valid proof of another learner (a learner speaking for someone else), or a call about another
learner than the one authenticated. 429: a learner past the proofs remembered for it in the window.

``AuthenticateFirst`` authenticates every learner route before anything else about the request is
read or checked, so a caller without a valid proof learns nothing (401), whatever its body.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from diloco_core.auth import TokenClaims, token_problem
from diloco_core.protocol import LEARNER_HEADER
from diloco_core.request_proof import (
    PROOF_SCHEME,
    SeenProofs,
    challenge,
    new_instance,
    proven_claims,
    read_proof,
    request_target,
    time_problem,
)
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import ApiError

AUTHENTICATED_LEARNER = "diloco_learner"  # key of the authenticated learner id in the request's state
TOKEN_CLAIMS = "diloco_claims"  # noqa: S105 (key of its token's claims in the state)


def _no_revocations(_learner: str) -> int:
    return 0


@dataclass(frozen=True)
class TokenCheck:
    """What a request's proof is checked against: the job secret, the lowest generation accepted per
    learner (the revocations), the clock, the proofs already accepted, and this process's instance
    (drawn once per process: a ``TokenCheck`` is made once, when the app is)."""

    job_secret: str
    min_generation: Callable[[str], int] = _no_revocations
    clock: Callable[[], float] = field(default=time.time)
    seen: SeenProofs = field(default_factory=SeenProofs)
    instance: str = field(default_factory=new_instance)

    def refused(self, reason: str, code: str = "unauthenticated", *, retryable: bool = False) -> ApiError:
        """401 with the challenge that names this process's instance."""
        headers = {"WWW-Authenticate": challenge(self.instance)}
        return ApiError(401, code, reason, retryable=retryable, headers=headers)


@dataclass(frozen=True)
class RequestHead:
    """What authenticates a request: its method, target (path from the API's root and query), the
    ``Authorization`` value and the ``X-DiLoCo-Learner`` header."""

    method: str
    target: str
    authorization: str | None
    learner: str | None

    @classmethod
    def of(cls, scope: Scope | Mapping[str, object]) -> RequestHead:
        headers = Headers(scope=scope)  # type: ignore[arg-type]
        query = scope.get("query_string", b"")
        target = request_target(str(scope["path"]), query if isinstance(query, bytes) else b"")
        return cls(str(scope["method"]), target, headers.get("authorization"), headers.get(LEARNER_HEADER))


def authenticate(check: TokenCheck, head: RequestHead, *, subject: str | None = None) -> TokenClaims:
    """The claims of the token that signed this request, or an ``ApiError`` (401/403/429).

    ``subject`` is the learner the call is about (path or body), which must be the learner named.
    """
    scheme = (head.authorization or "").partition(" ")[0].lower()
    if not head.authorization:
        raise check.refused(f"missing 'Authorization: {PROOF_SCHEME} <proof>' (diloco_core.request_proof)")
    if scheme == "bearer":
        raise check.refused(
            f"a bearer token is not accepted: sign each request with the token ({PROOF_SCHEME}, "
            "diloco_core.request_proof), so that the token itself never crosses the wire"
        )
    claimed = head.learner
    if not claimed:
        raise check.refused(f"missing {LEARNER_HEADER} header")
    proof = read_proof(head.authorization)
    if proof is None:
        raise check.refused(f"malformed {PROOF_SCHEME} proof for learner {claimed!r}")
    claims = proven_claims(check.job_secret, proof, head.method, head.target, check.instance)
    if claims is None:
        raise check.refused(
            f"invalid proof for learner {claimed!r}: not this request's, not for this synchronizer process "
            "(sign for the instance its challenge names), or not the job's token"
        )
    now = check.clock()
    if claims.learner != claimed:
        raise ApiError(403, "forbidden", f"the token belongs to another learner, not to {claimed!r}")
    problem = token_problem(claims, claimed, now, check.min_generation(claimed))
    if problem is not None:
        raise check.refused(problem)
    late = time_problem(proof, now)
    if late is not None:  # signed by the learner: its clock, not its token, is wrong
        if proof.signed_at > now:  # used up now, or it would be good once the clock catches up
            check.seen.admit(claimed, proof, now)  # the learner's own valid token: only it counts there
        raise check.refused(late, "clock_skew", retryable=True)
    if subject is not None:
        same_learner(claimed, subject)
    refusal = check.seen.admit(claimed, proof, now)
    if refusal is not None:
        kind, reason = refusal
        if kind == "replay":
            raise check.refused(reason)
        raise ApiError(429, "too_many_requests", reason, headers={"Retry-After": "10"})
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


def authenticated_or_none(check: TokenCheck, scope: Scope) -> str | None:
    """The learner the request authenticates, or None (for routes that answer everyone, and tell a
    learner more)."""
    try:
        return authenticate(check, RequestHead.of(scope)).learner
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
        try:
            claims = authenticate(self.check, RequestHead.of(scope))
        except ApiError as exc:
            refusal = JSONResponse(exc.body.model_dump(), status_code=exc.status, headers=exc.headers)
            await refusal(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state[AUTHENTICATED_LEARNER] = claims.learner
        state[TOKEN_CLAIMS] = claims
        await self.app(scope, receive, send)
