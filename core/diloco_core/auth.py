"""Learner tokens: signed claims about one learner, minted from the job secret.

A token is ``dl2.<claims>.<mac>``: the claims (JSON, base64url) name the learner, when the token was
issued and when it expires, its generation (a revocation counter: the synchronizer refuses a learner's
tokens below the generation it was told of) and the most tokens the learner trains on per step (its
unit's batch x context x accumulation x pods, where the minting side knows it). The mac is
HMAC-SHA256 of the claims under the job secret, so only the job secret's holder (the operator, or
``diloco run``) can mint one, and a token read from one learner is good for that learner alone, until
it expires or is revoked.

The synchronizer holds the job secret and checks a token without any state of its own
(``read_learner_token`` then ``token_problem``); the revocations are the only thing it is told.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass

TOKEN_PREFIX = "dl2"  # noqa: S105 (the format's name)
TOKEN_CONTEXT = b"diloco-learner-token-v2:"
MAX_TOKEN_CHARS = 2048  # a longer bearer is refused before it is decoded
CLOCK_LEEWAY_S = 300  # expiry and issue times are compared with this much slack between clocks
MAX_STEP_S = 3600.0  # the longest step time a token may declare for its unit


@dataclass(frozen=True)
class TokenClaims:
    """What a learner token says. ``expires_at`` None: never expires; ``tokens_per_step`` None: not
    declared (the synchronizer then applies only its general bounds); ``min_step_s``: the fewest
    seconds a step of the learner's unit takes (None: not declared, the job's bound applies)."""

    learner: str
    issued_at: int
    expires_at: int | None = None
    generation: int = 0
    tokens_per_step: int | None = None
    min_step_s: float | None = None


def b64url(data: bytes) -> str:
    """Base64url without padding (tokens' and request proofs' parts)."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def token_mac(job_secret: str, payload: str) -> str:
    """The mac of a token's claims (base64url) under the job secret: the token's signature, and the key
    its requests are signed with (``diloco_core.request_proof``)."""
    return b64url(hmac.new(job_secret.encode(), TOKEN_CONTEXT + payload.encode(), hashlib.sha256).digest())


def mint_token(job_secret: str, claims: TokenClaims) -> str:
    """The signed token carrying ``claims``."""
    if not job_secret:
        raise ValueError("job secret is empty")
    if not claims.learner:
        raise ValueError("learner id is empty")
    body = {"sub": claims.learner, "iat": claims.issued_at, "gen": claims.generation}
    if claims.expires_at is not None:
        body["exp"] = claims.expires_at
    if claims.tokens_per_step is not None:
        body["tps"] = claims.tokens_per_step
    if claims.min_step_s is not None:
        if _seconds(claims.min_step_s) is None:
            raise ValueError(f"min_step_s must be a number of seconds in (0, {MAX_STEP_S:g}]")
        body["mss"] = claims.min_step_s
    payload = b64url(json.dumps(body, separators=(",", ":"), sort_keys=True).encode())
    return f"{TOKEN_PREFIX}.{payload}.{token_mac(job_secret, payload)}"


def learner_token(
    job_secret: str,
    learner_id: str,
    *,
    issued_at: int = 0,
    expires_at: int | None = None,
    generation: int = 0,
    tokens_per_step: int | None = None,
    min_step_s: float | None = None,
) -> str:
    """A token for ``learner_id`` (by default issued at 0, never expiring, generation 0)."""
    return mint_token(
        job_secret, TokenClaims(learner_id, issued_at, expires_at, generation, tokens_per_step, min_step_s)
    )


def _int(value: object, *, positive: bool = False) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if value >= (1 if positive else 0) else None


def _seconds(value: object) -> float | None:
    """A step time in (0, MAX_STEP_S] seconds (an int or float, finite), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if 0 < value <= MAX_STEP_S else None  # NaN fails both comparisons


def read_learner_token(job_secret: str, token: str) -> TokenClaims | None:
    """The claims of a token signed with ``job_secret``, or None for anything else (wrong secret,
    altered claims, another format, malformed)."""
    if not job_secret or not token or len(token) > MAX_TOKEN_CHARS:
        return None
    prefix, _, rest = token.partition(".")
    payload, _, mac = rest.partition(".")
    if prefix != TOKEN_PREFIX or not payload or not mac:
        return None
    if not hmac.compare_digest(token_mac(job_secret, payload).encode(), mac.encode()):
        return None
    return claims_of(payload)


def claims_of(payload: str) -> TokenClaims | None:
    """The claims a token's payload (base64url JSON) says, or None when malformed. The mac is not
    checked here: only for claims whose mac was checked (``read_learner_token``, or a request proof
    signed with it)."""
    if len(payload) > MAX_TOKEN_CHARS:
        return None
    try:
        body = json.loads(_unb64(payload))
    except (ValueError, binascii.Error):
        return None
    if not isinstance(body, dict) or not isinstance(body.get("sub"), str) or not body["sub"]:
        return None
    issued, generation = _int(body.get("iat")), _int(body.get("gen", 0))
    expires = _int(body["exp"]) if "exp" in body else None
    tps = _int(body["tps"], positive=True) if "tps" in body else None
    mss = _seconds(body["mss"]) if "mss" in body else None
    if (
        issued is None
        or generation is None
        or ("exp" in body and expires is None)
        or ("tps" in body and tps is None)
        or ("mss" in body and mss is None)
    ):
        return None
    return TokenClaims(body["sub"], issued, expires, generation, tps, mss)


def token_problem(claims: TokenClaims, learner_id: str, now: float, min_generation: int = 0) -> str | None:
    """Why a validly signed token may not act as ``learner_id`` now, or None."""
    if claims.learner != learner_id:
        return f"the token belongs to another learner, not to {learner_id!r}"
    if claims.expires_at is not None and now > claims.expires_at + CLOCK_LEEWAY_S:
        return f"the token for {learner_id!r} expired at {claims.expires_at} (unix time); use the renewed one"
    if claims.generation < min_generation:
        return (
            f"the token for {learner_id!r} is of generation {claims.generation}, revoked (the job "
            f"accepts generation {min_generation} or later)"
        )
    return None


def verify_learner_token(job_secret: str, learner_id: str, token: str, now: float = 0.0) -> bool:
    """Whether ``token`` is a valid, unexpired token of ``learner_id`` (revocations aside)."""
    claims = read_learner_token(job_secret, token)
    return claims is not None and token_problem(claims, learner_id, now) is None


def new_job_secret() -> str:
    """A fresh random job secret (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)
