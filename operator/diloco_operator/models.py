"""Typed model of a DiLoCoJob's spec, matching crds/dilocojobs.diloco.dev.yaml field for field.

Field names are snake_case in Python and camelCase (the CRD's spelling) on the wire. The apiserver
has already applied the schema's defaults and ranges; the checks that the schema cannot express
(quorum against the number of units, name lengths, references) live in ``validate_job``.
"""

from __future__ import annotations

from typing import Any, Literal

from diloco_core.config import MergeRule, Quantizer
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

# A StatefulSet's pods carry a `controller-revision-hash` label of `<name>-<10 chars>` (≤ 63).
MAX_STATEFULSET_NAME = 52


class SpecError(ValueError):
    """The spec can never work as written; the message says what to change."""


class _Spec(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class SecretKeyRef(_Spec):
    name: str = Field(..., min_length=1)
    key: str = Field(..., min_length=1)


class Images(_Spec):
    worker: str = Field(..., min_length=1)
    synchronizer: str = Field(..., min_length=1)
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"


class ModelSpec(_Spec):
    entry_point: str = "builtin"
    n_layer: int = Field(4, ge=1)
    n_head: int = Field(4, ge=1)
    n_embd: int = Field(128, ge=8)
    block_size: int = Field(128, ge=8)
    seed: int = 0


class DataSpec(_Spec):
    corpus: str = "stdlib"
    non_iid: bool = False


class TrainSpec(_Spec):
    lr: float = Field(1e-3, gt=0.0)
    warmup_steps: int = Field(50, ge=0)
    grad_accum: int = Field(1, ge=1)
    weight_decay: float = Field(0.1, ge=0.0)


class CredentialsRef(_Spec):
    name: str = Field(..., min_length=1)
    access_key_id_key: str = "AWS_ACCESS_KEY_ID"
    secret_access_key_key: str = "AWS_SECRET_ACCESS_KEY"  # noqa: S105 (a key name)


class StorageSpec(_Spec):
    endpoint: str | None = None
    bucket: str = Field(..., min_length=3, max_length=63)
    prefix: str = ""
    region: str | None = None
    credentials_secret_ref: CredentialsRef | None = None

    @property
    def url(self) -> str:
        prefix = self.prefix.strip("/")
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"


class DiLoCoSpec(_Spec):
    inner_steps: int = Field(32, ge=1)
    fragments: int = Field(4, ge=1)
    overlap: int = Field(2, ge=0)
    quorum: int = Field(1, ge=1)
    grace_gamma: float = Field(0.5, ge=0.0, le=1.0)
    outer_lr: float = Field(0.7, gt=0.0, le=10.0)
    outer_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    delayed_nesterov: int = Field(0, ge=0, le=1024)
    codec: Quantizer = "int4"
    mixing_alpha: float = Field(0.0, ge=0.0, le=1.0)
    merge_rule: MergeRule = "rda"
    token_weighting: bool = True
    max_staleness: int = Field(4, ge=0)
    heartbeat_timeout_seconds: float = Field(30.0, gt=0.0)



class LearnerUnit(_Spec):
    name: str = Field(..., min_length=1, max_length=40, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    replicas: int = Field(1, ge=0, le=1024)
    gpus: int = Field(0, ge=0, le=64)
    resources: dict[str, Any] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(default_factory=dict)
    affinity: dict[str, Any] | None = None
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    region: str | None = None
    batch_size: int = Field(16, ge=1)


class ExternalSynchronizer(_Spec):
    url: str = Field(..., min_length=1)
    token_secret_ref: SecretKeyRef
    # The external synchronizer's job (its DiLoCoJob's name in the other cluster): the learners'
    # job config carries it, and the operator reads status only from a synchronizer serving it.
    job_id: str | None = Field(None, min_length=1, max_length=63)


class SynchronizerSpec(_Spec):
    shards: int = Field(1, ge=1, le=64)
    resources: dict[str, Any] = Field(default_factory=dict)
    external: ExternalSynchronizer | None = None


class Budget(_Spec):
    tokens: int | None = Field(None, ge=1)
    steps: int | None = Field(None, ge=1)


class ChaosSpec(_Spec):
    enabled: bool = False
    mtbf_seconds: float = Field(600.0, gt=0.0)
    repair_seconds: float = Field(0.0, ge=0.0)
    units: list[str] = Field(default_factory=list)


class DiLoCoJobSpec(_Spec):
    images: Images
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    train: TrainSpec = TrainSpec()
    storage: StorageSpec
    diloco: DiLoCoSpec = DiLoCoSpec()
    learner_units: list[LearnerUnit] = Field(..., min_length=1)
    synchronizer: SynchronizerSpec = SynchronizerSpec()
    budget: Budget = Budget()
    suspend: bool = False
    unit_lost_after_seconds: float = Field(300.0, gt=0.0)
    chaos: ChaosSpec = ChaosSpec()


def parse_spec(spec: dict[str, Any]) -> DiLoCoJobSpec:
    """Parse the custom resource's spec; raise SpecError naming every offending field."""
    try:
        return DiLoCoJobSpec.model_validate(spec)
    except ValidationError as exc:
        problems = "; ".join(
            f"spec.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise SpecError(problems) from None


def validate_job(name: str, spec: DiLoCoJobSpec) -> None:
    """Checks the schema cannot express; raise SpecError with what to change."""
    d = spec.diloco
    if d.overlap >= d.inner_steps:
        raise SpecError(f"spec.diloco.overlap ({d.overlap}) must be smaller than innerSteps ({d.inner_steps})")
    names = [u.name for u in spec.learner_units]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SpecError(f"spec.learnerUnits: unit names must be unique, repeated: {', '.join(dupes)}")
    if d.quorum > len(names):
        raise SpecError(
            f"spec.diloco.quorum ({d.quorum}) exceeds the number of learner units ({len(names)}); "
            "lower the quorum or add units"
        )
    for unit in spec.learner_units:
        full = f"{name}-{unit.name}"
        if len(full) > MAX_STATEFULSET_NAME:
            raise SpecError(
                f"job name + unit name '{full}' is {len(full)} characters; at most {MAX_STATEFULSET_NAME} allowed"
            )
    unknown = sorted(set(spec.chaos.units) - set(names))
    if unknown:
        raise SpecError(f"spec.chaos.units names units that do not exist: {', '.join(unknown)}")


def secret_references(spec: DiLoCoJobSpec) -> list[tuple[str, str]]:
    """(secret name, key) pairs the spec refers to; each must exist before children are created."""
    refs: list[tuple[str, str]] = []
    creds = spec.storage.credentials_secret_ref
    if creds is not None:
        refs += [(creds.name, creds.access_key_id_key), (creds.name, creds.secret_access_key_key)]
    external = spec.synchronizer.external
    if external is not None:
        refs.append((external.token_secret_ref.name, external.token_secret_ref.key))
    return refs
