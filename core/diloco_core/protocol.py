"""The learner ↔ synchronizer HTTP protocol: routes, headers and JSON bodies.

Shared by the synchronizer (server) and the worker (client) so both sides agree by construction.
Binary fragment payloads (codec format, ``application/octet-stream``) travel as request/response
bodies; their metadata travels as query parameters (requests) or headers (responses).

Routes (all under ``/v1``, their paths the ``*_PATH`` constants below; every learner call carries
``Authorization: DiLoCo-Proof <proof>`` (the request signed with the learner's token, which never
crosses the wire: ``diloco_core.request_proof``) and ``X-DiLoCo-Learner: <learner id>``, checked
before anything else about the request, so a malformed request without a valid proof answers 401;
the OpenAPI document declares the proof scheme on each). Every number a learner sends is bounded
(``diloco_core.bounds``): beyond a bound, or not finite, the answer is 400 ``bad_request``. Every
refusal, the server framework's own included (404 ``not_found``, 405 ``method_not_allowed``, a
body that is not UTF-8 JSON), carries an ``ErrorBody``.

- ``POST /v1/learners/register``  RegisterRequest → RegisterResponse, which carries the job's fragment
  plan and its hash (409 ``plan_mismatch`` when the learner's plan hash differs from the job's).
- ``POST /v1/learners/{learner_id}/heartbeat``  Heartbeat → HeartbeatResponse
  (404 ``not_registered`` for a learner the synchronizer does not know, e.g. after it lost its
  registry: the learner registers again; contributions answer the same).
- ``POST /v1/learners/{learner_id}/leave``  → 204. Afterwards the learner's heartbeats and
  contributions answer 409 ``left`` until it registers again, which is how it rejoins.
- ``PUT  /v1/fragments/{p}/init``  body: codec payload (kind "params", fp32 or fp32-planes) → 200 FragmentVersionInfo;
  accepted only while the fragment has no version yet (409 ``already_initialised`` afterwards).
- ``POST /v1/fragments/{p}/contributions?base_version=&steps=&tokens=&seq=``  body: codec payload
  (kind "outer_grad") → 202 ContributionResult; errors → ErrorBody with a 4xx/5xx status:
  400 ``corrupt``/``truncated``/``wrong_shape``/``non_finite``/``bad_request``, 404 ``unknown_fragment``,
  409 ``stale`` (resynchronise the fragment), ``left``, ``already_merged`` (the progress, or progress
  on a newer base, is merged), ``overlaps_pending`` or ``out_of_order`` (``since`` is not where the
  learner's progress on that base is held through: send the earlier parts first), 413 ``oversized``,
  429 ``too_many_requests`` (the learner's uploads or requests in progress are at their limit: retry),
  503 ``storage_unavailable`` (retry). ``tokens`` is at most 1e9 per step, also summed over the
  parts a contribution continues.
  Idempotent on (learner, fragment, base_version, seq): a repeat answers ``duplicate``.
- ``GET  /v1/fragments/{p}?newer_than=v&wait=s[&announce_rounds=true]``  → 200 codec payload (kind "params",
  fp32-planes) with headers ``X-DiLoCo-Version`` and ``X-DiLoCo-Fragment``; 304 when no newer version arrived
  within ``wait``. With ``announce_rounds=true`` (a learner asking to be pulled) it also answers early
  with 204 No Content when a round on version ``v`` of fragment ``p`` is open (its first contribution
  was accepted) and the calling learner has not contributed to it: headers ``X-DiLoCo-Round-Open: v``
  and, once the round's quorum is reached, ``X-DiLoCo-Round-Deadline-S`` (seconds left of its grace
  window). The learner then sends its partial outer gradient (steps/tokens so far) at its next step
  boundary; contributions accepted before the deadline join the round.
- ``POST /v1/data/ranges``  RangeRequest → RangeResponse: the range of the job's training stream that
  holds a position of the calling unit's own data sequence (``diloco_core.dealing``), dealt once and
  durable before the answer, so a position always maps to the same range; 409 ``deal_refused`` for a
  position too far past the unit's ranges, or from a synchronizer shard other than 0 (the dealer),
  503 ``storage_unavailable`` (retry).
- ``GET  /v1/status`` → StatusResponse;  ``GET /metrics``, ``/healthz``, ``/readyz``, ``/`` (HTML page);
  ``/readyz`` names the storage and the failing object only to a caller with a learner's token.

Fragment maps (``versions``, ``fragment_steps``, ``fragment_tokens``) are JSON objects keyed by
fragment index: ``0`` or decimal digits without a leading zero, as their schema's ``propertyNames``
says; other keys are refused.

Several shards: fragment p is served by shard p % N (``diloco_core.sharding``); another shard answers
421 ``wrong_shard``. A learner registers with every shard listed in ``RegisterResponse.shards``,
heartbeats each, and sends each fragment's calls to its owner.

JSON bodies (register, heartbeat) larger than the synchronizer's JSON body limit (1 MiB by default)
are refused with 413 ``oversized``, whether or not they announce a ``Content-Length``.

While a synchronizer is still loading its state (at start-up, for as long as its storage is
unreachable), every ``/v1`` route answers 503 ``starting`` (``retryable``, with a ``Retry-After``
header): the learner retries. Meanwhile ``/healthz`` answers 200 and ``/readyz`` 503 with a ``reason``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from diloco_core.bounds import (
    MAX_BYTES,
    MAX_LOSS,
    MAX_STEP_TIME_S,
    MAX_STEPS,
    MAX_TOKENS_PER_STEP,
    FragmentKey,
    Seconds,
    Steps,
    Tokens,
    fragment_map,
)
from diloco_core.dealing import MAX_POSITION, MAX_RANGE

API_PREFIX = "/v1"
# The routes under API_PREFIX; a placeholder is named as the synchronizer's path parameter
# (``REGISTER_PATH``: the server declares it, the client fills it with ``str.format``).
REGISTER_PATH = "/learners/register"
HEARTBEAT_PATH = "/learners/{learner_id}/heartbeat"
LEAVE_PATH = "/learners/{learner_id}/leave"
INIT_PATH = "/fragments/{p}/init"
CONTRIBUTIONS_PATH = "/fragments/{p}/contributions"
FRAGMENT_PATH = "/fragments/{p}"
STATUS_PATH = "/status"
DATA_RANGES_PATH = "/data/ranges"
LEARNER_HEADER = "X-DiLoCo-Learner"
VERSION_HEADER = "X-DiLoCo-Version"
FRAGMENT_HEADER = "X-DiLoCo-Fragment"
ROUND_OPEN_HEADER = "X-DiLoCo-Round-Open"
ROUND_DEADLINE_HEADER = "X-DiLoCo-Round-Deadline-S"
# a heartbeat riding on a request sent anyway (a contribution, a long-poll): the ``Heartbeat`` as JSON;
# the answer carries HEARTBEAT_RECORDED_HEADER when it was recorded (else the learner's own heartbeat
# request, sent when nothing carried one for an interval, hears why)
HEARTBEAT_HEADER = "X-DiLoCo-Heartbeat"
HEARTBEAT_RECORDED_HEADER = "X-DiLoCo-Heartbeat-Recorded"
CONTENT_TYPE = "application/octet-stream"

LearnerState = Literal["training", "rejoining", "leaving", "left", "dead"]


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RangeRequest(_Msg):
    """The range of the calling unit's data that holds ``position`` of its sequence; ranges dealt to
    reach it hold ``size`` positions each."""

    position: int = Field(..., ge=0, le=MAX_POSITION)
    size: int = Field(..., ge=1, le=MAX_RANGE)


class RangeResponse(_Msg):
    offset: int = Field(..., description="the range's first position in the unit's sequence")
    start: int = Field(..., description="the range's first position in the job's training stream")
    size: int


class RegisterRequest(_Msg):
    learner_id: str = Field(..., min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    unit: str = Field("", max_length=128, description="learner unit (island) this learner belongs to")
    plan: dict[str, Any] = Field(..., description="the learner's fragment plan (FragmentPlan.to_dict())")
    plan_hash: str = Field(..., min_length=16, max_length=128)
    tokens_per_step: int = Field(..., ge=1, le=MAX_TOKENS_PER_STEP)
    step: Steps = Field(0, description="the learner's step counter (non-zero after a resume)")


class ShardInfo(_Msg):
    index: int
    url: str
    fragments: list[int]


class RegisterResponse(_Msg):
    job_id: str
    learner_id: str
    plan_hash: str
    plan: dict[str, Any] | None = Field(
        None,
        description="the job's fragment plan (FragmentPlan.to_dict(): tensor names, shapes, fragment "
        "assignment, H, overlap); its hash is plan_hash. Absent from synchronizers older than this field",
    )
    versions: dict[FragmentKey, int] = fragment_map(
        "fragment → newest global version (-1: none yet)", required=True
    )
    needs_init: list[int] = Field(
        default_factory=list,
        description="fragments this learner must upload with /init (those another learner is initialising "
        "are not listed: they have version -1 until it is done)",
    )
    initial_digests: dict[FragmentKey, Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]] = fragment_map(
        "fragment → digest of its initial parameters (diloco_core.downlink.digest), for fragments still at "
        "version 0: a learner whose own initial parameters have that digest holds version 0 and takes "
        "nothing"
    )
    diloco: dict[str, Any] = Field(..., description="the job's DiLoCoSettings")
    shards: list[ShardInfo] = Field(default_factory=list)
    heartbeat_interval_s: float


class Heartbeat(_Msg):
    """What a learner reports; every number is bounded (``diloco_core.bounds``) and finite."""

    step: Steps
    tokens: Tokens = Field(..., description="tokens trained on in total")
    step_time_s: float = Field(
        ...,
        ge=0.0,
        le=MAX_STEP_TIME_S,
        allow_inf_nan=False,
        description="recent inner step time (0: not measured)",
    )
    state: LearnerState = "training"
    fragment_steps: dict[FragmentKey, Annotated[int, Field(ge=-MAX_STEPS, le=MAX_STEPS)]] = fragment_map(
        "steps since last sync, per fragment"
    )
    fragment_tokens: dict[FragmentKey, Tokens] = fragment_map("tokens since last sync, per fragment")
    eval_loss: float | None = Field(None, ge=-MAX_LOSS, le=MAX_LOSS, allow_inf_nan=False)
    bytes_sent: int = Field(0, ge=0, le=MAX_BYTES, description="payload bytes of the contributions sent")
    wire_sent: int = Field(
        0,
        ge=0,
        le=MAX_BYTES,
        description="bytes at the socket the learner's connections sent (heads, bodies, TLS; diloco_core.wire)",
    )
    wire_received: int = Field(0, ge=0, le=MAX_BYTES, description="bytes at the socket they received")
    blocked_s: Seconds = Field(0.0, description="total time spent blocked on communication")


class HeartbeatResponse(_Msg):
    versions: dict[FragmentKey, int] = fragment_map(
        "fragment → newest global version (-1: none yet)", required=True
    )
    alive_learners: int


class ContributionResult(_Msg):
    status: Literal["accepted", "duplicate"]
    fragment: int
    base_version: int
    version: int = Field(..., description="the fragment's newest version when the contribution was taken")
    pending: int = Field(..., description="contributions waiting for this fragment's next round")
    durable: bool = Field(
        True,
        description="true: the contribution is in storage (or merged) and survives a restart of the "
        "synchronizer; false: it is only buffered in memory (storage is down) and is lost if the "
        "synchronizer dies before storage is back: resend it (same seq) until an answer says durable",
    )


class ErrorBody(_Msg):
    code: str
    reason: str
    retryable: bool = False
    current_version: int | None = None


class FragmentVersionInfo(_Msg):
    fragment: int
    version: int


class LearnerStatus(_Msg):
    learner_id: str
    unit: str
    state: LearnerState
    alive: bool
    step: int
    tokens: int
    step_time_s: float
    staleness: int = Field(..., description="max over fragments of (global version - learner's base version)")
    last_seen_s: float
    eval_loss: float | None = None
    contributions: int = 0
    bytes_sent: int = 0
    bytes_received: int = Field(
        0, description="global-version bytes served to this learner since the synchronizer started"
    )
    wire_sent: int = Field(0, description="bytes at the socket the learner reports its connections sent")
    wire_received: int = Field(0, description="bytes at the socket the learner reports they received")
    blocked_s: float = 0.0


class ExcludedContribution(_Msg):
    learner: str
    key: str
    reason: str


class RoundRecord(_Msg):
    fragment: int
    version: int
    participants: list[str]
    weights: list[float]
    base_versions: list[int]
    finished_at: float
    quorum_wait_s: float
    grace_s: float
    merge_s: float
    steps: list[int] = Field(
        default_factory=list, description="inner steps each participant's contribution held"
    )
    tokens: list[int] = Field(default_factory=list, description="tokens each participant's contribution held")
    excluded: list[ExcludedContribution] = Field(
        default_factory=list, description="contributions the round's checks left out, with the reason"
    )
    clipped: list[ExcludedContribution] = Field(
        default_factory=list,
        description="contributions merged scaled down to the round's norm limit, with the reason",
    )
    update_clipped: str | None = Field(
        None, description="why the merged outer gradient was scaled down to its limit, when it was"
    )
    update_norm: float | None = Field(
        None, description="norm of the merged outer gradient the outer step took (how far the round moved)"
    )


class FragmentStatus(_Msg):
    fragment: int
    version: int
    pending: int
    rounds: int
    excluded: int = Field(
        0,
        description="contributions the rounds' checks excluded since the synchronizer started (see its log)",
    )
    clipped: int = Field(
        0,
        description="contributions merged scaled down to their norm limit since the synchronizer started",
    )


class StatusResponse(_Msg):
    job_id: str
    shard: int
    num_shards: int
    learners: list[LearnerStatus]
    fragments: list[FragmentStatus]
    rounds: int
    recent_rounds: list[RoundRecord]
    bytes_in: int
    bytes_out: int
    wire_in: int = Field(
        0,
        description="bytes at the socket every connection brought in since the synchronizer started "
        "(heads, bodies, TLS; read from the kernel's TCP counters where it has them)",
    )
    wire_out: int = Field(0, description="bytes at the socket every connection took out since it started")
    tokens: int
    goodput: float | None = None
    storage_ok: bool = True
    eval_loss: float | None = None
