"""The synchronizer's configuration: one typed object, parsed once by the command line.

Every field is a flag and a ``DILOCO_*`` variable of ``diloco synchronizer`` (``diloco_sync.cli``),
its description the flag's help; ``job.job_id`` and every field of ``job.diloco`` are flags too.
``job_owner`` (``--job-owner``) names the job in its storage prefix's marker (``diloco_core.ownership``).
"""

from __future__ import annotations

from typing import Annotated

from diloco_core.config import JobConfig
from diloco_core.endpoint_url import EndpointUrl
from diloco_core.flags import Cli
from diloco_core.sharding import shard_fragments, shard_of
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from .publication import DEFAULT_SERVED_IN_MEMORY


class SyncSettings(BaseModel):
    """Everything the service needs to start. Built by ``diloco_sync.cli`` from flags and ``DILOCO_*``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job: JobConfig = JobConfig()
    job_secret: SecretStr = Field(..., description="the job secret (prefer DILOCO_JOB_SECRET)")
    job_owner: str | None = Field(
        None,
        description="who owns the storage prefix, named in its marker job.json: a synchronizer of "
        "another owner refuses the prefix (default: the job id; the operator gives <namespace>/<name>)",
    )
    storage_url: Annotated[str, Cli("storage")] = Field(
        ..., description="file:///path or s3://bucket/prefix (default: file:// of --data-dir)"
    )
    storage_endpoint_url: EndpointUrl | None = Field(
        None, description="S3 endpoint (default: AWS_ENDPOINT_URL)"
    )
    storage_region: str | None = Field(None, description="S3 region (default: AWS_REGION)")
    storage_access_key: str | None = Field(None, description="S3 access key (default: AWS_ACCESS_KEY_ID)")
    storage_secret_key: SecretStr | None = Field(
        None, description="S3 secret key (default: AWS_SECRET_ACCESS_KEY; prefer DILOCO_STORAGE_SECRET_KEY)"
    )
    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 in a container)")
    port: int = Field(8470, ge=0, le=65535, description="port to listen on")
    plan_path: Annotated[str | None, Cli("plan")] = Field(
        None, description="fragment plan JSON; default: adopt the first learner's"
    )
    shard_index: int = Field(
        0, ge=0, description="this replica's shard (fragment p belongs to shard p % num_shards)"
    )
    num_shards: int = Field(1, ge=1, description="number of synchronizer replicas")
    shard_urls: tuple[str, ...] = Field((), description="base URLs of all shards, in shard order")
    tls_cert: str | None = Field(None, description="TLS certificate file (PEM)")
    tls_key: str | None = Field(None, description="TLS private key file (PEM)")
    max_body_bytes: int | None = Field(
        None,
        ge=1024,
        description="largest accepted payload (init, contributions); default: the largest a payload "
        "of its fragment can be in any format, from the fragment plan",
    )
    max_json_body_bytes: int = Field(
        1024 * 1024, ge=1024, description="largest JSON request body (register, heartbeat)"
    )
    memory_budget_bytes: int = Field(
        1024 * 1024 * 1024, ge=0, description="contributions held while storage is down"
    )
    keep_versions: int = Field(4, ge=1, description="fragment versions kept in storage")
    served_in_memory_bytes: int = Field(
        DEFAULT_SERVED_IN_MEMORY,
        ge=0,
        description="largest fragment version held in memory; a fragment whose version can be larger "
        "(about its fp32 size, the most a version can be) is served from its object in storage to each "
        "reader that needs it whole (updates are always served from memory), its new versions are "
        "encoded by the commit as they are written, and its parameters and outer state are read back "
        "from storage by its next round instead of held",
    )
    round_memory_bytes: int = Field(
        1024 * 1024 * 1024,
        ge=0,
        description="memory the rounds between their merge and their commit may hold together, each "
        "counted as six times its fragment's fp32 size (ten when it reads its state back from "
        "storage); a round starts whenever no other is in "
        "progress, so a larger fragment still merges (0: one round at a time)",
    )
    pending_memory_bytes: int = Field(
        1024 * 1024 * 1024,
        ge=0,
        description="memory the contributions waiting for or in their rounds may hold together, with "
        "the bodies being received; a learner's first contribution to a fragment's round is always "
        "taken, a further part beyond it is answered 503 pending_full (retryable) until a round frees "
        "room (0: one contribution per learner and fragment at a time)",
    )
    heartbeat_interval_s: float = Field(5.0, gt=0.0, description="heartbeat interval told to learners")
    max_wait_s: float = Field(60.0, gt=0.0, description="longest long-poll a learner may ask for")
    tick_s: float = Field(0.25, gt=0.0, description="longest sleep of the round loop between checks")
    storage_retry_max_s: float = Field(5.0, gt=0.0, description="cap of the storage retry backoff")
    recent_rounds: int = Field(50, ge=1, description="rounds shown by the status")
    max_grace_s: float = Field(
        300.0,
        gt=0.0,
        description="longest grace window after a round's quorum, whatever step times learners report",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0.0,
        description="time a connection has to send a whole request head (from when it opened "
        "or from the previous answer)",
    )
    body_timeout_s: float = Field(
        60.0, gt=0.0, description="longest pause while a request body is being received"
    )
    keep_alive_timeout_s: float = Field(
        5.0, gt=0.0, description="idle time before a kept-alive connection is closed"
    )
    min_body_rate: float = Field(
        1024.0,
        ge=0.0,
        description="bytes/s a request body must average once it has been arriving for "
        "--header-timeout-s (0: no minimum)",
    )
    max_requests_per_learner: int = Field(
        0, ge=0, description="requests one learner may have in progress at once (0: twice the fragments + 16)"
    )
    max_uploads_per_learner: int = Field(
        4, ge=1, description="uploads (init, contributions) one learner may have in progress at once"
    )
    min_step_time_s: float = Field(
        0.0005,
        ge=0.0,
        description="the fastest an inner step of this job's learners can be: a contribution "
        "claiming more steps on a version than its age allows at this pace (plus twice the inner steps) is "
        "refused (0: no bound)",
    )
    revocations_file: str | None = Field(
        None,
        description="JSON file of the lowest learner-token generation accepted per learner id "
        '({"learner": 2}), re-read when it changes (the operator keeps it in a ConfigMap)',
    )
    max_connections: int = Field(
        4096,
        ge=8,
        description="open connections at most (fewer if the limit of open files is lower); "
        "beyond it a connection waiting for its request head is closed, else the new one gets 503",
    )

    @model_validator(mode="after")
    def _check(self) -> SyncSettings:
        if self.shard_index >= self.num_shards:
            raise ValueError(
                f"shard_index ({self.shard_index}) must be smaller than num_shards ({self.num_shards})"
            )
        if self.shard_urls and len(self.shard_urls) != self.num_shards:
            raise ValueError(f"{len(self.shard_urls)} shard URLs given for {self.num_shards} shards")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both a certificate and a key")
        if not self.job_secret.get_secret_value():
            raise ValueError("the job secret is empty")
        if (self.storage_access_key is None) != (self.storage_secret_key is None):
            raise ValueError("S3 credentials need both the access key and the secret key")
        return self

    @property
    def owner(self) -> str:
        """The job's identity in the storage prefix's marker (``diloco_core.ownership``)."""
        return self.job_owner or self.job.job_id

    @property
    def owned_fragments(self) -> list[int]:
        """Fragments this shard owns: fragment p belongs to shard p % num_shards."""
        return shard_fragments(self.shard_index, self.num_shards, self.job.diloco.fragments)

    def owns(self, fragment: int) -> bool:
        return (
            0 <= fragment < self.job.diloco.fragments
            and shard_of(fragment, self.num_shards) == self.shard_index
        )
