"""HTTP routes under /v1 (thin: parse, authenticate, call the service, shape the answer).

The protocol (routes, headers, bodies) is fixed in ``diloco_core.protocol``; every number a learner
sends is bounded there and here (``diloco_core.bounds``). Every learner route is authenticated by
``auth.AuthenticateFirst`` before the request is read, then answers 503 ``starting`` until the
synchronizer has loaded its state (``startup``).
"""

from __future__ import annotations

import re
from typing import Annotated

import anyio.to_thread
from diloco_core.bounds import (
    MAX_FRAGMENTS,
    MAX_SEQ,
    MAX_STEPS,
    MAX_TOKENS,
    MAX_TOKENS_PER_STEP,
    MAX_VERSION,
    MAX_WAIT_S,
)
from diloco_core.protocol import (
    API_PREFIX,
    CONTENT_TYPE,
    CONTRIBUTIONS_PATH,
    DATA_RANGES_PATH,
    FRAGMENT_HEADER,
    FRAGMENT_PATH,
    HEARTBEAT_HEADER,
    HEARTBEAT_PATH,
    INIT_PATH,
    LEARNER_HEADER,
    LEAVE_PATH,
    REGISTER_PATH,
    ROUND_DEADLINE_HEADER,
    ROUND_OPEN_HEADER,
    STATUS_PATH,
    VERSION_HEADER,
    ContributionResult,
    FragmentVersionInfo,
    Heartbeat,
    HeartbeatResponse,
    RangeRequest,
    RangeResponse,
    RegisterRequest,
    RegisterResponse,
    StatusResponse,
)
from diloco_core.request_proof import PROOF_SCHEME
from diloco_core.uploads import reading
from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response, Security
from fastapi.responses import Response as RawResponse
from fastapi.security import HTTPAuthorizationCredentials
from fastapi.security.http import HTTPBase

from .auth import AUTHENTICATED_LEARNER, TOKEN_CLAIMS, declared_problem, same_learner
from .body import declared_length, discard, receive_body, scratch_upload
from .carried_heartbeat import record_carried
from .contributions import ContributionDesk
from .dealer import Dealer
from .errors import ApiError, error_responses
from .publication import Stored
from .service import RoundOpen, SyncService
from .startup import Startup
from .stored_version import stored_response

router = APIRouter(prefix=API_PREFIX)
_BINARY_ROUTE = re.compile(
    "|".join(
        re.escape(API_PREFIX + path).replace(re.escape("{p}"), "[^/]+")
        for path in (INIT_PATH, CONTRIBUTIONS_PATH)
    )
)
_PUBLIC_ROUTES = frozenset({API_PREFIX + STATUS_PATH})

_BINARY = {"schema": {"type": "string", "format": "binary"}}
_BINARY_BODY = {
    "requestBody": {
        "required": True,
        "content": {CONTENT_TYPE: _BINARY},
        "description": "a codec payload (diloco_core.codec)",
    }
}
_FRAGMENT = {FRAGMENT_HEADER: {"description": "the fragment answered", "schema": {"type": "integer"}}}
_proof = HTTPBase(
    scheme=PROOF_SCHEME,
    auto_error=False,
    scheme_name="LearnerRequestProof",
    description="the request signed with the learner's token (diloco_core.request_proof: method, path "
    f"and query, time, nonce; each proof used once), sent with the {LEARNER_HEADER} header naming that learner",
)


def is_binary_route(path: str) -> bool:
    """The routes whose codec payload body ``receive_body`` limits (init, contributions)."""
    return _BINARY_ROUTE.fullmatch(path) is not None


def is_learner_route(path: str) -> bool:
    """The paths only an authenticated learner may call: everything under /v1 but the status."""
    return path.startswith(API_PREFIX + "/") and path not in _PUBLIC_ROUTES


def get_service(request: Request) -> SyncService:
    """The service, once its state is loaded; 503 ``starting`` (retry later) until then."""
    startup: Startup = request.app.state.startup
    startup.check_ready()
    service: SyncService = request.app.state.service
    return service


def get_desk(request: Request) -> ContributionDesk:
    desk: ContributionDesk = request.app.state.desk
    return desk


def get_dealer(request: Request) -> Dealer:
    """The dealer of the job's data, once the state is loaded (503 ``starting`` until then)."""
    startup: Startup = request.app.state.startup
    startup.check_ready()
    dealer: Dealer = request.app.state.dealer
    return dealer


Service = Annotated[SyncService, Depends(get_service)]


def get_public_service(request: Request) -> SyncService:
    """The service for a route that answers everyone: while it starts, 503 ``starting`` with a reason
    that names nothing of the storage (endpoint, bucket, keys: a start-up failure may)."""
    startup: Startup = request.app.state.startup
    startup.check_ready(detailed=False)
    service: SyncService = request.app.state.service
    return service


PublicService = Annotated[SyncService, Depends(get_public_service)]
Desk = Annotated[ContributionDesk, Depends(get_desk)]
DataDealer = Annotated[Dealer, Depends(get_dealer)]


def authenticated_learner(
    request: Request,
    _token: Annotated[HTTPAuthorizationCredentials | None, Security(_proof)],
    _learner: Annotated[
        str | None, Header(alias=LEARNER_HEADER, description="the calling learner's id")
    ] = None,
) -> str:
    """The learner ``auth.AuthenticateFirst`` authenticated before the request was read (401/403 with
    the protocol's error bodies). The proof scheme and the learner header are declared here for the
    OpenAPI document."""
    learner_id: str = request.scope["state"][AUTHENTICATED_LEARNER]
    return learner_id


Learner = Annotated[str, Depends(authenticated_learner)]
FragmentIndex = Annotated[int, Path(ge=0, lt=MAX_FRAGMENTS, description="the fragment")]
CarriedHeartbeat = Annotated[
    str | None,
    Header(
        alias=HEARTBEAT_HEADER,
        description="a heartbeat (the heartbeat request's JSON body) riding on this request; the answer "
        "has X-DiLoCo-Heartbeat-Recorded: 1 when it was recorded",
    ),
]


@router.post(
    REGISTER_PATH, response_model=RegisterResponse, responses=error_responses(400, 401, 403, 409, 429, 503)
)
async def register(body: RegisterRequest, service: Service, learner: Learner) -> RegisterResponse:
    """Register (or re-register) a learner: returns the plan hash, versions and job settings.

    A learner that left comes back this way (until then its heartbeats and contributions answer 409
    ``left``)."""
    same_learner(learner, body.learner_id)
    return await service.register(body)


@router.post(
    HEARTBEAT_PATH,
    response_model=HeartbeatResponse,
    responses=error_responses(400, 401, 403, 404, 409, 429, 503),
)
async def heartbeat(
    learner_id: str, body: Heartbeat, service: Service, learner: Learner
) -> HeartbeatResponse:
    """Report progress (step, tokens, step time, optional held-out loss); answers the versions.

    404 ``not_registered`` when the synchronizer does not know the learner: register again;
    409 ``left`` after the learner left: register again to rejoin.
    """
    same_learner(learner, learner_id)
    return service.heartbeat(learner_id, body)


@router.post(
    DATA_RANGES_PATH, response_model=RangeResponse, responses=error_responses(400, 401, 409, 429, 503)
)
async def data_range(body: RangeRequest, dealer: DataDealer, learner: Learner) -> RangeResponse:
    """The range of the job's training stream that holds a position of the calling unit's data
    (``diloco_core.dealing``): the same answer for the same position, before and after any restart;
    409 ``deal_refused`` for a position too far past the unit's ranges."""
    dealt = await dealer.range(learner, body.position, body.size)
    return RangeResponse(offset=dealt.offset, start=dealt.start, size=dealt.size)


@router.post(LEAVE_PATH, status_code=204, responses=error_responses(401, 403, 429, 503))
async def leave(learner_id: str, service: Service, learner: Learner) -> Response:
    """Leave the quorum cleanly (a learner shutting down); registering again undoes it."""
    same_learner(learner, learner_id)
    await service.leave(learner_id)
    return Response(status_code=204)


@router.put(
    INIT_PATH,
    response_model=FragmentVersionInfo,
    responses=error_responses(400, 401, 403, 404, 409, 413, 421, 429, 503),
    openapi_extra=_BINARY_BODY,
)
async def init_fragment(
    request: Request, service: Service, desk: Desk, p: FragmentIndex, _learner: Learner
) -> FragmentVersionInfo:
    """Upload initial parameters (kind "params", fp32 or fp32-planes); only while it has no version."""
    body = await anyio.to_thread.run_sync(scratch_upload)
    try:
        await receive_body(request, desk.body_limit(p), body)
        with reading(body) as blob:
            return await service.init_fragment(p, blob)
    finally:
        await discard(body)


@router.post(
    CONTRIBUTIONS_PATH,
    status_code=202,
    response_model=ContributionResult,
    responses=error_responses(400, 401, 403, 404, 409, 413, 421, 429, 503),
    openapi_extra=_BINARY_BODY,
)
async def contribute(
    request: Request,
    response: Response,
    service: Service,
    desk: Desk,
    p: FragmentIndex,
    learner_id: Learner,
    base_version: Annotated[
        int, Query(ge=0, le=MAX_VERSION, description="the version the outer gradient is relative to")
    ],
    steps: Annotated[int, Query(ge=1, le=MAX_STEPS, description="inner steps since that version")],
    tokens: Annotated[
        int,
        Query(
            ge=0,
            le=MAX_TOKENS,
            description=f"tokens trained on since that version (at most {MAX_TOKENS_PER_STEP:.0e} per step)",
        ),
    ],
    seq: Annotated[
        int, Query(ge=0, le=MAX_SEQ, description="the learner's sequence number (idempotency)")
    ] = 0,
    since: Annotated[
        int,
        Query(
            ge=0,
            le=MAX_STEPS,
            description="the learner's steps on that version already sent: the outer gradient holds the progress after them",
        ),
    ] = 0,
    heartbeat: CarriedHeartbeat = None,
) -> ContributionResult:
    """Contribute an outer gradient (codec payload, kind "outer_grad") to a fragment's next round.
    It may carry a heartbeat (``X-DiLoCo-Heartbeat``)."""
    carried: dict[str, str] = {}
    record_carried(heartbeat, learner_id, service.heartbeat, carried)
    response.headers.update(carried)
    if tokens > steps * MAX_TOKENS_PER_STEP:
        raise ApiError(
            400,
            "bad_request",
            f"{tokens} tokens in {steps} steps is more than {MAX_TOKENS_PER_STEP:.0e} tokens per step",
        )
    claims = request.scope["state"][TOKEN_CLAIMS]
    declared = declared_problem(claims, steps, tokens)
    if declared is not None:
        raise ApiError(400, "bad_request", declared)
    desk.precheck(learner_id, p, base_version, seq, since, steps, tokens, claims.min_step_s)
    limit = desk.body_limit(p)
    size = declared_length(request, limit)
    with desk.room(learner_id, p, base_version, seq, limit if size is None else size):
        body = await anyio.to_thread.run_sync(desk.open_body, learner_id, p, base_version, seq)
        try:
            await receive_body(request, limit, body, desk.storage_failed)
            started = service.clock()
            result = await desk.contribute(
                learner_id,
                p,
                base_version=base_version,
                steps=steps,
                tokens=tokens,
                seq=seq,
                body=body,
                since=since,
                unit_min_step_s=claims.min_step_s,
            )
        finally:
            await discard(body)
    service.metrics.ingest_seconds.observe(service.clock() - started)
    return result


@router.get(
    FRAGMENT_PATH,
    responses={
        200: {
            "content": {CONTENT_TYPE: _BINARY},
            "description": "the newest version (codec payload, kind params)",
            "headers": {
                VERSION_HEADER: {"description": "the version sent", "schema": {"type": "integer"}},
                **_FRAGMENT,
            },
        },
        204: {
            "description": "announce_rounds only: a round on version newer_than is open and this learner has "
            "not contributed to it; send the partial outer gradient now",
            "headers": {
                ROUND_OPEN_HEADER: {"description": "the round's version", "schema": {"type": "integer"}},
                **_FRAGMENT,
                ROUND_DEADLINE_HEADER: {
                    "description": "seconds left until the grace deadline (absent before the quorum)",
                    "schema": {"type": "number"},
                },
            },
        },
        304: {"description": "no version newer than newer_than arrived within wait", "headers": _FRAGMENT},
        **error_responses(401, 403, 404, 409, 421, 429, 503),
    },
    response_class=RawResponse,
)
async def fetch_fragment(
    service: Service,
    p: FragmentIndex,
    learner_id: Learner,
    newer_than: Annotated[
        int, Query(ge=-1, le=MAX_VERSION, description="answer only a version newer than this")
    ] = -1,
    wait: Annotated[
        float,
        Query(
            ge=0.0,
            le=MAX_WAIT_S,
            allow_inf_nan=False,
            description="seconds to wait for a newer version (long-poll; the synchronizer caps it)",
        ),
    ] = 0.0,
    announce_rounds: Annotated[
        bool,
        Query(description="answer 204 when a round on newer_than opens that this learner has not joined"),
    ] = False,
    have: Annotated[
        int,
        Query(
            ge=-1,
            le=MAX_VERSION,
            description="the version this learner holds exactly: with the job's down_codec, the next "
            "version comes as the update from it (a codec payload of kind 'update'; -1: send it whole)",
        ),
    ] = -1,
    heartbeat: CarriedHeartbeat = None,
) -> Response:
    """The newest version of a fragment, with ``X-DiLoCo-Version``; 304 if none newer arrives in time;
    204 with ``X-DiLoCo-Round-Open`` when asked to announce a round this learner should join. It may
    carry a heartbeat (``X-DiLoCo-Heartbeat``), recorded before the wait."""
    carried: dict[str, str] = {}
    record_carried(heartbeat, learner_id, service.heartbeat, carried)
    found = await service.fetch(learner_id, p, newer_than, wait, announce_rounds=announce_rounds, have=have)
    if isinstance(found, RoundOpen):
        headers = {ROUND_OPEN_HEADER: str(found.version), FRAGMENT_HEADER: str(p), **carried}
        if found.deadline_s is not None:
            headers[ROUND_DEADLINE_HEADER] = f"{found.deadline_s:.3f}"
        return Response(status_code=204, headers=headers)
    if found is None:
        return Response(status_code=304, headers={FRAGMENT_HEADER: str(p), **carried})
    version, payload = found
    headers = {VERSION_HEADER: str(version), FRAGMENT_HEADER: str(p), **carried}
    if isinstance(payload, Stored):
        return await stored_response(service.store.read_range, payload, p, CONTENT_TYPE, headers)
    return Response(content=payload, media_type=CONTENT_TYPE, headers=headers)


@router.get(STATUS_PATH, response_model=StatusResponse, responses=error_responses(503))
async def status(service: PublicService) -> StatusResponse:
    """Learners, fragment versions, recent rounds, traffic and storage health (no secrets)."""
    return service.status()
