"""A learner's requests signed with its token, so that what crosses the wire is good for one request.

A learner holds its whole token, ``dl2.<claims>.<mac>`` (``diloco_core.auth``), and never sends the
mac. Each request carries instead::

    Authorization: DiLoCo-Proof dl2.<claims>.<time>.<nonce>.<signature>

where ``signature`` is HMAC-SHA256 (its first 128 bits), keyed with the token's mac, of the
request's method, its target (the path from the API's root and the query string), the time it was
signed (unix seconds) and a random nonce. The synchronizer recomputes the mac from the job secret
and the claims, so it keeps no key per learner; it accepts a proof once (``SeenProofs``), within
``PROOF_WINDOW_S`` either way of its own clock. A proof read off the wire (plain HTTP, a log, a proxy) is therefore good for the same method,
path and query once per synchronizer process (each shard, and a restarted process, keeps its own
record), within minutes, and for nothing else: not another route, another query, a later time, or
another learner. The body is not signed: hashing a contribution of half a gigabyte would cost the
synchronizer a core-second, and TLS (required whenever the synchronizer is reached from another
cluster) keeps bodies from being changed on the way; a contribution's effect is bounded by its
token's claims whatever its body. A replay to another shard may carry another body (a forged
heartbeat of that learner, once per process); see docs/internals.md.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Generator
from dataclasses import dataclass

import httpx

from .auth import TOKEN_PREFIX, b64url, token_mac

PROOF_SCHEME = "DiLoCo-Proof"
PROOF_CONTEXT = b"diloco-request-proof-v1\n"
PROOF_WINDOW_S = 300  # a proof signed further from the synchronizer's clock is refused
MAX_PROOF_CHARS = 2400
MAX_PROOFS_PER_LEARNER = 20_000  # proofs remembered per learner within the window (a replay check)
# on every request's head: a signature of 128 bits (HMAC-SHA256 truncated, as RFC 2104 allows down to
# half its length; a proof lives minutes) and a nonce of 96 random bits (no repeat among a learner's
# proofs in a window) keep a head 13 bytes longer than a bearer token's instead of 40
SIGNATURE_BYTES = 16
NONCE_BYTES = 12


class NotALearnerToken(ValueError):
    """What was given to sign with is not a whole learner token (``dl2.<claims>.<mac>``)."""


@dataclass(frozen=True)
class RequestProof:
    """An ``Authorization: DiLoCo-Proof`` value, split (nothing checked yet)."""

    claims: str  # the token's claims, base64url (``dl2.<claims>.<mac>`` without the mac)
    signed_at: int  # unix seconds
    nonce: str
    signature: str


def signing_input(method: str, target: str, signed_at: int, nonce: str) -> bytes:
    """What the signature covers: method, target (path and query), time, nonce."""
    return PROOF_CONTEXT + f"{method.upper()}\n{target}\n{signed_at}\n{nonce}".encode()


def _signature(mac: str, method: str, target: str, signed_at: int, nonce: str) -> str:
    digest = hmac.new(mac.encode(), signing_input(method, target, signed_at, nonce), hashlib.sha256).digest()
    return b64url(digest[:SIGNATURE_BYTES])


def request_target(path: str, query: str | bytes = "") -> str:
    """The signed target: the path from the API's root, then ``?query`` when there is one."""
    text = query.decode("latin-1") if isinstance(query, bytes) else query
    return f"{path}?{text}" if text else path


def prove(token: str, method: str, target: str, *, now: float | None = None, nonce: str | None = None) -> str:
    """The ``Authorization`` value for one request, signed with ``token`` (the learner's whole token)."""
    prefix, _, rest = token.partition(".")
    claims, _, mac = rest.partition(".")
    if prefix != TOKEN_PREFIX or not claims or not mac or "." in mac:
        raise NotALearnerToken("not a learner token (dl2.<claims>.<mac>)")
    signed_at = int(time.time() if now is None else now)
    nonce = nonce or b64url(secrets.token_bytes(NONCE_BYTES))
    sig = _signature(mac, method, target, signed_at, nonce)
    return f"{PROOF_SCHEME} {TOKEN_PREFIX}.{claims}.{signed_at}.{nonce}.{sig}"


def read_proof(authorization: str | None) -> RequestProof | None:
    """The proof an ``Authorization`` value carries, or None (another scheme, malformed)."""
    if not authorization or len(authorization) > MAX_PROOF_CHARS:
        return None
    scheme, _, value = authorization.partition(" ")
    parts = value.strip().split(".")
    if scheme.lower() != PROOF_SCHEME.lower() or len(parts) != 5 or parts[0] != TOKEN_PREFIX:
        return None
    _, claims, signed_at, nonce, sig = parts
    if (
        not claims
        or not nonce
        or not sig
        or not (signed_at.isascii() and signed_at.isdigit())
        or len(signed_at) > 12
    ):
        return None
    return RequestProof(claims, int(signed_at), nonce, sig)


def proven_token(job_secret: str, proof: RequestProof, method: str, target: str) -> str | None:
    """The whole token whose mac signed this request (to read its claims), or None: a signature
    that is not this request's under the token the job secret makes for these claims."""
    mac = token_mac(job_secret, proof.claims)
    expected = _signature(mac, method, target, proof.signed_at, proof.nonce)
    if not hmac.compare_digest(expected.encode(), proof.signature.encode()):
        return None
    return f"{TOKEN_PREFIX}.{proof.claims}.{mac}"


def time_problem(proof: RequestProof, now: float) -> str | None:
    """Why the proof's time is not accepted now, or None."""
    if abs(now - proof.signed_at) <= PROOF_WINDOW_S:
        return None
    return (
        f"the request was signed at {proof.signed_at} (unix time), more than {PROOF_WINDOW_S} s from the "
        f"synchronizer's clock ({int(now)}): check both machines' clocks"
    )


class SeenProofs:
    """The proofs accepted within the window, per learner: each is accepted once. Kept in memory
    (a restart forgets them; a proof from before a restart is still bound to its one request and
    time). At most ``MAX_PROOFS_PER_LEARNER`` per learner; beyond that the learner's requests are
    refused until the window moves on, which one learner cannot do to another."""

    def __init__(self, limit: int = MAX_PROOFS_PER_LEARNER) -> None:
        self.limit = limit
        self._seen: dict[str, OrderedDict[str, float]] = {}

    def admit(self, learner: str, proof: RequestProof, now: float) -> tuple[str, str] | None:
        """Record the proof, or why it may not be used: ("replay", reason) for a proof used before,
        ("busy", reason) for a learner at its limit."""
        seen = self._seen.setdefault(learner, OrderedDict())
        while seen and next(iter(seen.values())) < now:
            seen.popitem(last=False)
        if proof.nonce in seen:
            return (
                "replay",
                f"this request of learner {learner!r} was received before (its proof is used once)",
            )
        if len(seen) >= self.limit:
            return "busy", f"learner {learner!r} made more than {self.limit} requests in {PROOF_WINDOW_S} s"
        seen[proof.nonce] = max(now, proof.signed_at) + PROOF_WINDOW_S
        return None


class ProofAuth(httpx.Auth):
    """httpx authentication that signs every request with a learner's token. ``token``: the token,
    or what gives the one to sign with now (re-read per request, so a renewed token is used at once);
    ``root``: the path of the client's base URL, left out of the signed target (the synchronizer
    sees the path from its API's root, whatever prefix a proxy routes on)."""

    def __init__(self, token: str | Callable[[], str], *, root: str = "") -> None:
        self._token = token if callable(token) else (lambda: token)
        self._root = root.rstrip("/")

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        path = request.url.path
        if self._root and path.startswith(self._root):
            path = path[len(self._root) :]
        target = request_target(path, request.url.query)
        request.headers["Authorization"] = prove(self._token(), request.method, target)
        yield request
