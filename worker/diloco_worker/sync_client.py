"""The HTTP client of the synchronizer API (routes and bodies: ``diloco_core.protocol``).

Thin I/O only: every call either returns a parsed body or raises :class:`SyncUnavailable`
(retry later: network failure, 5xx, 503, a success answer whose body is not the expected JSON:
:class:`SyncBadAnswer`) or :class:`SyncRejected` (the request itself was refused).
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import pydantic
from diloco_core import protocol as proto
from diloco_core.request_proof import NotALearnerToken, ProofAuth
from diloco_core.wire import WireTally

from .carried_beats import CarriedBeats
from .credentials import TokenSource
from .routing import Routes, single_route
from .wire_transport import counting_transport


class SyncError(Exception):
    """A call to the synchronizer failed."""


class SyncUnavailable(SyncError):
    """The synchronizer could not be reached or asked to retry."""


class SyncUntrusted(SyncUnavailable):
    """The synchronizer's TLS certificate was not accepted (not signed by a trusted CA, or not for
    its address): retrying cannot cure it unless the certificate or the CA bundle changes."""


class SyncBadAnswer(SyncUnavailable):
    """A success answer whose body is not the JSON the route returns (a proxy's or load balancer's
    page, a body cut short): retried like an unreachable synchronizer, since what answered is usually
    in front of it and passing. A contribution sent again is safe: one the synchronizer took is
    answered ``duplicate``."""


class SyncRejected(SyncError):
    """The synchronizer refused the request (``code`` from its ErrorBody)."""

    def __init__(self, status: int, code: str, reason: str, current_version: int | None = None) -> None:
        super().__init__(f"HTTP {status} {code}: {reason}")
        self.status, self.code, self.reason, self.current_version = status, code, reason, current_version


@dataclass(frozen=True)
class GlobalFragment:
    fragment: int
    version: int
    payload: bytes


@dataclass(frozen=True)
class RoundOpen:
    """A round of ``fragment`` on ``version`` asks for this learner's partial progress."""

    fragment: int
    version: int
    deadline_s: float | None  # seconds left of its grace window, when the synchronizer knows it


def _round_open(fragment: int, resp: httpx.Response) -> RoundOpen:
    try:
        version = int(resp.headers[proto.ROUND_OPEN_HEADER])
        raw = resp.headers.get(proto.ROUND_DEADLINE_HEADER)
        deadline = float(raw) if raw is not None else None
    except (KeyError, ValueError) as exc:
        raise SyncRejected(
            resp.status_code, "bad_response", f"204 without a valid {proto.ROUND_OPEN_HEADER} header"
        ) from exc
    return RoundOpen(fragment, version, deadline)


_Body = TypeVar("_Body", bound=pydantic.BaseModel)


def _parse(model: type[_Body], resp: httpx.Response) -> _Body:
    """``resp``'s body as ``model``, or :class:`SyncBadAnswer` when it is not that JSON."""
    try:
        return model.model_validate(resp.json())
    except (ValueError, pydantic.ValidationError) as exc:  # a JSONDecodeError is a ValueError
        kind = resp.headers.get("Content-Type", "no content type")
        raise SyncBadAnswer(
            f"{resp.request.method} {resp.request.url.path}: HTTP {resp.status_code} ({kind}) is not a "
            f"{model.__name__}: {resp.text[:120]!r}"
        ) from exc


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    try:
        body = proto.ErrorBody.model_validate(resp.json())
        code, reason, retryable, current = body.code, body.reason, body.retryable, body.current_version
    except (ValueError, TypeError):
        code, reason, retryable, current = f"http_{resp.status_code}", resp.text[:200], False, None
    if resp.status_code >= 500 or resp.status_code == 429 or retryable:
        raise SyncUnavailable(f"HTTP {resp.status_code} {code}: {reason}")
    raise SyncRejected(resp.status_code, code, reason, current)


def tls_verify(ca_file: str | None) -> ssl.SSLContext | bool:
    """How an https synchronizer's certificate is checked: against ``ca_file`` (a PEM bundle), or
    the public certificate authorities (True). Raises ``ValueError`` when the bundle is unusable.

    The check is strict (``VERIFY_X509_STRICT``, Python 3.13's default) on every Python, so a
    certificate that one learner image accepts is never refused by another: the CA certificate
    must carry a keyUsage extension, a certificate it issues an authority key identifier."""
    if ca_file is None:
        return True
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(
            f"cannot read the CA bundle {ca_file} (--sync-ca-file / DILOCO_SYNC_CA_FILE): {exc}"
        ) from exc
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    return context


def _certificate_problem(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate check that failed somewhere in ``exc``'s chain, if that is what failed."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLCertVerificationError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class SyncClient:
    """One learner's connection to the synchronizer; safe to share between threads."""

    def __init__(
        self,
        base_url: str,
        learner_id: str,
        token: str | TokenSource,
        *,
        timeout_s: float = 30.0,
        verify: ssl.SSLContext | bool = True,
        wire: WireTally | None = None,
    ) -> None:
        """``token``: the learner token, or where to read it each time (``TokenSource``);
        ``verify``: how an https synchronizer's certificate is checked (``tls_verify``); ``wire``:
        where the bytes at the socket of this client's connections are counted (shared by a
        learner's clients)."""
        self.learner_id, self.base_url, self.verify = learner_id, base_url, verify
        self.token = token if isinstance(token, TokenSource) else TokenSource(token)
        self.wire = wire if wire is not None else WireTally()
        self.beats = CarriedBeats()  # heartbeats its contributions and long-polls carry
        self._http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers={proto.LEARNER_HEADER: learner_id},
            timeout=httpx.Timeout(timeout_s, connect=5.0),
            transport=counting_transport(self.wire, verify),
            auth=ProofAuth(self.token.current, root=httpx.URL(base_url).path),
        )
        # every request's head is on the learner's link: none of httpx's defaults that say nothing here
        # (HTTP/1.1 keeps the connection alive anyway; payloads are zstd already, answers never compressed)
        for name in ("Accept", "Accept-Encoding", "Connection"):
            self._http.headers.pop(name, None)
        self._http.headers["User-Agent"] = "diloco"

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            resp = self._http.request(method, proto.API_PREFIX + path, **kwargs)
        except NotALearnerToken as exc:  # the token held cannot sign (a malformed token file): as if refused
            raise SyncRejected(
                401, "unauthenticated", f"the learner token cannot sign requests: {exc}"
            ) from exc
        except httpx.HTTPError as exc:
            problem = _certificate_problem(exc)
            if problem is not None:
                raise SyncUntrusted(
                    f"the TLS certificate of the synchronizer at {self.base_url} is not trusted: "
                    f"{problem.verify_message or problem.reason}; give the CA bundle that signed it with "
                    "--sync-ca-file / DILOCO_SYNC_CA_FILE, and check that the certificate names this address "
                    "and that the CA's certificate has a keyUsage extension"
                ) from exc
            raise SyncUnavailable(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        _raise_for(resp)
        return resp

    def register(self, req: proto.RegisterRequest) -> proto.RegisterResponse:
        resp = self._request("POST", proto.REGISTER_PATH, json=req.model_dump(mode="json"))
        return _parse(proto.RegisterResponse, resp)

    def heartbeat(self, hb: proto.Heartbeat, *, timeout_s: float | None = None) -> proto.HeartbeatResponse:
        extra: dict[str, Any] = {"timeout": timeout_s} if timeout_s is not None else {}
        path = proto.HEARTBEAT_PATH.format(learner_id=self.learner_id)
        sent_at = self.beats.clock()
        self.beats.sending(sent_at)
        resp = self._request("POST", path, json=hb.model_dump(mode="json"), **extra)
        answer = _parse(proto.HeartbeatResponse, resp)  # what answered with another body did not hear it
        self.beats.beat(sent_at)
        return answer

    def leave(self, *, timeout_s: float | None = None) -> None:
        extra: dict[str, Any] = {"timeout": timeout_s} if timeout_s is not None else {}
        self._request("POST", proto.LEAVE_PATH.format(learner_id=self.learner_id), **extra)

    def data_range(self, position: int, size: int) -> proto.RangeResponse:
        """The range of the job's training stream that holds ``position`` of this unit's data (new
        ranges of ``size`` positions)."""
        resp = self._request("POST", proto.DATA_RANGES_PATH, json={"position": position, "size": size})
        return _parse(proto.RangeResponse, resp)

    def init_fragment(self, fragment: int, payload: bytes) -> proto.FragmentVersionInfo:
        resp = self._request(
            "PUT",
            proto.INIT_PATH.format(p=fragment),
            content=payload,
            headers={"Content-Type": proto.CONTENT_TYPE},
        )
        return _parse(proto.FragmentVersionInfo, resp)

    def contribute(
        self,
        fragment: int,
        payload: bytes,
        *,
        base_version: int,
        steps: int,
        tokens: int,
        seq: int,
        since: int = 0,
    ) -> proto.ContributionResult:
        params = {"base_version": base_version, "steps": steps, "tokens": tokens, "seq": seq}
        if since:
            params["since"] = since
        sent_at = self.beats.clock()
        resp = self._request(
            "POST",
            proto.CONTRIBUTIONS_PATH.format(p=fragment),
            params=params,
            content=payload,
            headers={"Content-Type": proto.CONTENT_TYPE, **self.beats.header(sent_at)},
        )
        self.beats.answered(sent_at, resp.headers)
        return _parse(proto.ContributionResult, resp)

    def fetch(
        self, fragment: int, *, newer_than: int, wait_s: float, announce_rounds: bool = False, have: int = -1
    ) -> GlobalFragment | RoundOpen | None:
        """The newest global version of ``fragment`` if newer than ``newer_than`` (long-poll ``wait_s``);
        with ``announce_rounds``, a :class:`RoundOpen` when a round on ``newer_than`` asks for this learner.
        ``have``: the version this learner holds exactly, from which the job's compressed downloads
        may send the next one as an update payload (-1: none)."""
        params: dict[str, str | int | float] = {"newer_than": newer_than, "wait": wait_s}
        if announce_rounds:
            params["announce_rounds"] = "true"
        if have >= 0:
            params["have"] = have
        resp = self._request(
            "GET",
            proto.FRAGMENT_PATH.format(p=fragment),
            params=params,
            timeout=httpx.Timeout(wait_s + 30.0, connect=5.0),
        )
        if resp.status_code == 304:
            return None
        if resp.status_code == 204:
            return _round_open(fragment, resp)
        try:
            version = int(resp.headers[proto.VERSION_HEADER])
        except (KeyError, ValueError) as exc:
            raise SyncRejected(
                resp.status_code, "bad_response", f"missing {proto.VERSION_HEADER} header"
            ) from exc
        return GlobalFragment(fragment, version, resp.content)

    def status(self) -> proto.StatusResponse:
        return _parse(proto.StatusResponse, self._request("GET", proto.STATUS_PATH))


class ShardClients:
    """One :class:`SyncClient` per synchronizer shard, and the routes that say which owns a fragment.

    With one shard (an unsharded synchronizer) every call goes through the single client."""

    def __init__(self, routes: Routes, clients: Mapping[int, SyncClient]) -> None:
        missing = {s.index for s in routes.shards} - clients.keys()
        if missing:
            raise ValueError(f"no client for shards {sorted(missing)}")
        self.routes = routes
        self._clients = dict(clients)

    @classmethod
    def single(cls, client: SyncClient, fragments: int) -> ShardClients:
        return cls(single_route(str(client.base_url), fragments), {0: client})

    @classmethod
    def connect(cls, routes: Routes, home: SyncClient) -> ShardClients:
        """Clients for ``routes``: ``home`` serves the home shard, a new client each other shard
        (with ``home``'s token, its bytes counted with ``home``'s)."""
        clients = {
            s.index: home
            if s.index == routes.home
            else SyncClient(s.url, home.learner_id, home.token, verify=home.verify, wire=home.wire)
            for s in routes.shards
        }
        return cls(routes, clients)

    @property
    def indices(self) -> list[int]:
        return [s.index for s in self.routes.shards]

    def shard(self, index: int) -> SyncClient:
        return self._clients[index]

    def owner(self, fragment: int) -> SyncClient:
        """The client of the shard that owns ``fragment``."""
        return self._clients[self.routes.owner(fragment)]

    def home(self) -> SyncClient:
        """The client of the shard the learner was given (shard 0 when the routes do not tell)."""
        return self._clients[self.routes.home if self.routes.home is not None else 0]

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
