"""The synchronizer's configuration: one typed object, parsed once by the command line."""

from __future__ import annotations

from diloco_core.config import JobConfig
from diloco_core.sharding import shard_fragments, shard_of
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator


class SyncSettings(BaseModel):
    """Everything the service needs to start. Built by ``diloco_sync.cli`` from flags and ``DILOCO_*``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job: JobConfig = JobConfig()
    job_secret: SecretStr
    storage_url: str = Field(..., description="file:///path or s3://bucket/prefix")
    storage_endpoint_url: str | None = None
    storage_region: str | None = None
    storage_access_key: str | None = Field(None, description="S3 access key (default: AWS_ACCESS_KEY_ID)")
    storage_secret_key: SecretStr | None = Field(
        None, description="S3 secret key (default: AWS_SECRET_ACCESS_KEY)"
    )
    host: str = "127.0.0.1"
    port: int = Field(8470, ge=0, le=65535)
    plan_path: str | None = Field(None, description="fragment plan JSON; default: adopt the first learner's")
    shard_index: int = Field(0, ge=0)
    num_shards: int = Field(1, ge=1)
    shard_urls: tuple[str, ...] = ()
    tls_cert: str | None = None
    tls_key: str | None = None
    max_body_bytes: int = Field(256 * 1024 * 1024, ge=1024)
    max_json_body_bytes: int = Field(
        1024 * 1024, ge=1024, description="largest JSON request body (register, heartbeat)"
    )
    memory_budget_bytes: int = Field(
        1024 * 1024 * 1024, ge=0, description="contributions held while storage is down"
    )
    keep_versions: int = Field(4, ge=1)
    heartbeat_interval_s: float = Field(5.0, gt=0.0)
    max_wait_s: float = Field(60.0, gt=0.0, description="longest long-poll a learner may ask for")
    tick_s: float = Field(0.25, gt=0.0, description="longest sleep of the round loop between checks")
    storage_retry_max_s: float = Field(5.0, gt=0.0, description="cap of the storage retry backoff")
    recent_rounds: int = Field(50, ge=1)

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
    def owned_fragments(self) -> list[int]:
        """Fragments this shard owns: fragment p belongs to shard p % num_shards."""
        return shard_fragments(self.shard_index, self.num_shards, self.job.diloco.fragments)

    def owns(self, fragment: int) -> bool:
        return (
            0 <= fragment < self.job.diloco.fragments
            and shard_of(fragment, self.num_shards) == self.shard_index
        )
