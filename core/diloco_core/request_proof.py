"""A learner's requests signed with its token, so that what crosses the wire is good for one request.

A learner holds its whole token, ``dl2.<claims>.<mac>`` (``diloco_core.auth``), and never sends the
mac. Each request carries instead::

    Authorization: DiLoCo-Proof dl2.<claims>.<time>.<nonce>.<signature>

where ``signature`` is HMAC-SHA256 (its first 128 bits), keyed with the token's mac, of the
request's method, its target (the path from the API's root and the query string), the time it was
signed (unix seconds), a random nonce, and the **instance** of the synchronizer process it is for.
Each synchronizer process draws its instance when it starts and names it in the challenge of every
401 (``WWW-Authenticate: DiLoCo-Proof instance="..."``); a client signs for the instance it was last
told and, refused with a challenge naming another one (its first request, or the process restarted),
signs again for that one and sends the request once more (``ProofAuth``), as HTTP Digest does with
its nonce. The synchronizer recomputes the mac from the job secret and the claims, so it keeps no key
per learner; it accepts a proof for its own instance only, once (``SeenProofs``), within
``PROOF_WINDOW_S`` either way of its own clock.

A proof read off the wire (plain HTTP, a log, a proxy) is therefore good for nothing once its request
was taken: not the same request again, nor at another shard or a restarted process (another
instance), another route, query, time or learner. A validly signed proof dated ahead of the
synchronizer's clock is refused and used up all the same. One refused because its learner made more
than ``MAX_PROOFS_PER_LEARNER`` requests in the window (429) is not used up: it may be sent once
more, for the same request, within its window. The body is not signed: hashing a contribution of half a gigabyte would cost the
synchronizer a core-second, and since the request's proof is used up by the request itself, only a
party that can stop the request and send another body in its place (a man in the middle) could
change one; TLS (required whenever the synchronizer is reached from another cluster) stops that, and
a contribution's effect is bounded by its token's claims whatever its body. See docs/internals.md.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import re
import secrets
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import httpx

from .auth import TOKEN_PREFIX, TokenClaims, b64url, claims_of, token_mac
from .protocol import REGISTER_PATH

PROOF_SCHEME = "DiLoCo-Proof"
PROOF_CONTEXT = b"diloco-request-proof-v2\n"
PROOF_WINDOW_S = 300  # a proof signed further from the synchronizer's clock is refused
MAX_PROOF_CHARS = 2400
MAX_PROOFS_PER_LEARNER = 20_000  # proofs remembered per learner within the window (a replay check)
# on every request's head: a signature of 128 bits (HMAC-SHA256 truncated, as RFC 2104 allows down to
# half its length; a proof lives minutes) and a nonce of 96 random bits (no repeat among a learner's
# proofs in a window) keep a head 13 bytes longer than a bearer token's instead of 40
SIGNATURE_BYTES = 16
NONCE_BYTES = 12
PROBE_ABOVE_BYTES = 64 * 1024  # a larger body is not sent before its instance is known (read first)
INSTANCE_BYTES = 12  # a synchronizer process's instance: 96 random bits drawn when it starts
_CHALLENGE_INSTANCE = re.compile(r'(?:^|[\s,])instance="([A-Za-z0-9_-]{1,64})"(?:$|[\s,])')


class NotALearnerToken(ValueError):
    """What was given to sign with is not a whole learner token (``dl2.<claims>.<mac>``)."""


@dataclass(frozen=True)
class RequestProof:
    """An ``Authorization: DiLoCo-Proof`` value, split (nothing checked yet)."""

    claims: str  # the token's claims, base64url (``dl2.<claims>.<mac>`` without the mac)
    signed_at: int  # unix seconds
    nonce: str
    signature: str


@dataclass(frozen=True)
class Signed:
    """What a signature covers: the request (method, target: path and query), the synchronizer
    process it is for (its instance), the time and the nonce."""

    method: str
    target: str
    instance: str
    signed_at: int
    nonce: str

    def text(self) -> bytes:
        fields = (self.method.upper(), self.target, self.instance, str(self.signed_at), self.nonce)
        return PROOF_CONTEXT + "\n".join(fields).encode()


def _signature(mac: str, signed: Signed) -> str:
    return b64url(hmac.new(mac.encode(), signed.text(), hashlib.sha256).digest()[:SIGNATURE_BYTES])


def new_instance() -> str:
    """A synchronizer process's instance, drawn when it starts (random, so no two processes share one)."""
    return b64url(secrets.token_bytes(INSTANCE_BYTES))


def challenge(instance: str) -> str:
    """The ``WWW-Authenticate`` value of a 401: the scheme, and the instance to sign for."""
    return f'{PROOF_SCHEME} instance="{instance}"'


def challenged_instance(www_authenticate: str | None) -> str | None:
    """The instance a ``WWW-Authenticate`` value asks to sign for, or None (no challenge of this
    scheme). A value may hold several challenges, a proxy's among them (``Basic realm="x",
    DiLoCo-Proof instance="..."``): the instance is the parameter of this scheme's challenge."""
    text = www_authenticate or ""
    at = re.search(rf"(?:^|[\s,]){re.escape(PROOF_SCHEME)}(?:\s+|$)", text, re.IGNORECASE)
    if at is None:
        return None
    params = text[at.end() :]
    following = re.search(r",\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+\s+[A-Za-z0-9!#$%&'*+.^_`|~-]+=", params)
    found = _CHALLENGE_INSTANCE.search(params[: following.start()] if following else params)
    return found.group(1) if found else None


def response_instance(response: httpx.Response) -> str | None:
    """The instance an answer's challenges ask to sign for (each ``WWW-Authenticate`` header read)."""
    for value in response.headers.get_list("WWW-Authenticate"):
        found = challenged_instance(value)
        if found is not None:
            return found
    return None


def request_target(path: str, query: str | bytes = "") -> str:
    """The signed target: the path from the API's root, then ``?query`` when there is one."""
    text = query.decode("latin-1") if isinstance(query, bytes) else query
    return f"{path}?{text}" if text else path


def prove(
    token: str,
    method: str,
    target: str,
    *,
    instance: str,
    now: float | None = None,
    nonce: str | None = None,
) -> str:
    """The ``Authorization`` value for one request to the synchronizer process ``instance``, signed
    with ``token`` (the learner's whole token)."""
    prefix, _, rest = token.partition(".")
    claims, _, mac = rest.partition(".")
    if prefix != TOKEN_PREFIX or not claims or not mac or "." in mac:
        raise NotALearnerToken("not a learner token (dl2.<claims>.<mac>)")
    signed_at = int(time.time() if now is None else now)
    nonce = nonce or b64url(secrets.token_bytes(NONCE_BYTES))
    sig = _signature(mac, Signed(method, target, instance, signed_at, nonce))
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


def proven_claims(
    job_secret: str, proof: RequestProof, method: str, target: str, instance: str
) -> TokenClaims | None:
    """The claims of the token whose mac signed this request (``method`` and ``target`` as
    received, for this process's ``instance``), or None: a signature that is not this request's for
    this instance under the token the job secret makes for these claims, or malformed claims."""
    if not job_secret:
        return None
    signed = Signed(method, target, instance, proof.signed_at, proof.nonce)
    expected = _signature(token_mac(job_secret, proof.claims), signed)
    if not hmac.compare_digest(expected.encode(), proof.signature.encode()):
        return None
    return claims_of(proof.claims)


def time_problem(proof: RequestProof, now: float) -> str | None:
    """Why the proof's time is not accepted now, or None."""
    if abs(now - proof.signed_at) <= PROOF_WINDOW_S:
        return None
    return (
        f"the request was signed at {proof.signed_at} (unix time), more than {PROOF_WINDOW_S} s from the "
        f"synchronizer's clock ({int(now)}): check both machines' clocks"
    )


def instance_at(api_root: str, **client_args: Any) -> str:
    """The instance of the synchronizer process at ``api_root`` (its URL with the API prefix), read
    from the challenge of an unsigned request: for a client that signs its requests itself
    (``ProofAuth`` learns it on its own). ``client_args``: httpx's (``verify``, ``timeout``)."""
    resp = httpx.post(api_root.rstrip("/") + REGISTER_PATH, **client_args)
    instance = response_instance(resp)
    if resp.status_code != 401 or instance is None:
        raise ValueError(
            f"{api_root} did not answer with a {PROOF_SCHEME} challenge (HTTP {resp.status_code})"
        )
    return instance


class SeenProofs:
    """The proofs accepted within the window, per learner: each is accepted once. Kept in memory: a
    proof is good for one process (its instance), so a restarted process needs none of them. At
    most ``MAX_PROOFS_PER_LEARNER`` per learner; beyond that the learner's requests are refused until
    the window moves on, which one learner cannot do to another."""

    def __init__(self, limit: int = MAX_PROOFS_PER_LEARNER) -> None:
        self.limit = limit
        self._seen: dict[str, tuple[set[str], list[tuple[float, str]]]] = {}

    def admit(self, learner: str, proof: RequestProof, now: float) -> tuple[str, str] | None:
        """Record the proof, or why it may not be used: ("replay", reason) for a proof used before,
        ("busy", reason) for a learner at its limit."""
        nonces, expiries = self._seen.setdefault(learner, (set(), []))
        while expiries and expiries[0][0] < now:  # the soonest to leave the window first
            nonces.discard(heapq.heappop(expiries)[1])
        if proof.nonce in nonces:
            return (
                "replay",
                f"this request of learner {learner!r} was received before (its proof is used once)",
            )
        if len(nonces) >= self.limit:
            return "busy", f"learner {learner!r} made more than {self.limit} requests in {PROOF_WINDOW_S} s"
        nonces.add(proof.nonce)
        heapq.heappush(expiries, (max(now, proof.signed_at) + PROOF_WINDOW_S, proof.nonce))
        return None


class ProofAuth(httpx.Auth):
    """httpx authentication that signs every request with a learner's token, for the synchronizer
    instance last named in a challenge; an answer whose challenge names another instance (a 401 to
    the first request or after a restart; ``/readyz``, which answers anyone, to a proof it could not
    use) is answered by signing for it and sending the request once more.
    A streamed body cannot be sent twice, and a large one should not be: before the first such
    request the instance is read from a request without body or proof to the same URL (answered
    401 before any body is read); a streamed request refused for a changed instance (a restart)
    returns its 401 to the caller. Only a 401, or the answer to a GET or HEAD, is answered by
    sending the request again: an answer that took the request is never followed by another.
    ``token``: the token, or what gives the one to sign with now (re-read per request, so a renewed
    token is used at once); ``root``: the path of the client's base URL, left out of the signed
    target (the synchronizer sees the path from its API's root, whatever prefix a proxy routes on)."""

    def __init__(self, token: str | Callable[[], str], *, root: str = "") -> None:
        self._token = token if callable(token) else (lambda: token)
        self._root = root.rstrip("/")
        self.instance = ""  # none known yet: the first request learns it from its 401

    def _sign(self, request: httpx.Request, instance: str) -> None:
        path = request.url.path
        if self._root and path.startswith(self._root):
            path = path[len(self._root) :]
        target = request_target(path, request.url.query)
        request.headers["Authorization"] = prove(self._token(), request.method, target, instance=instance)

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        resendable = isinstance(request.stream, httpx.ByteStream)
        large = resendable and len(request.content) > PROBE_ABOVE_BYTES
        if not self.instance and (large or not resendable):  # read the instance without the body
            probe = yield httpx.Request(request.method, request.url, headers={"Content-Length": "0"})
            self.instance = response_instance(probe) or self.instance
        signed_for = self.instance
        self._sign(request, signed_for)
        response = yield request
        named = response_instance(response)
        # only a refusal (or a read, such as /readyz) is sent again: an answer that took the request
        # is never repeated, whatever challenge it carries
        taken = response.status_code != 401 and request.method not in ("GET", "HEAD")
        if named is None or named == signed_for or taken:
            return  # served, or refused for another reason than the instance: the caller sees the answer
        self.instance = named
        if resendable:
            self._sign(request, named)
            yield request
