"""Typed model of a DiLoCoJob's spec, matching crds/dilocojobs.diloco.dev.yaml field for field.

Field names are snake_case in Python and camelCase (the CRD's spelling) on the wire. The sections
``model``, ``train``, ``data`` and ``diloco`` are the core's settings themselves
(``diloco_core.config``) under their CRD names (:func:`crd_name`): a setting is declared once, in
core, and every setting of those sections has a CRD field, except the ones ``NO_CRD_FIELD`` lists
with the reason (a test checks both). The apiserver has already applied
the schema's defaults and ranges; the checks that the schema cannot express (quorum against the
number of units, synchronizer shards against fragments, name lengths, references) live in
``validate_job``.
"""

from __future__ import annotations

from typing import Any, Literal

from diloco_core.auth import MAX_STEP_S
from diloco_core.config import DataSettings, DiLoCoSettings, ModelSettings, TrackingSettings, TrainSettings
from diloco_core.endpoint_url import EndpointUrl
from diloco_core.validation_errors import describe_errors, dotted
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from diloco_operator.schema import pod_additions
from diloco_operator.schema.job_names import name_problems
from diloco_operator.schema.patterns import LABEL_KEY, LABEL_VALUE
from diloco_operator.schema.pod_settings import PodSettings, merged
from diloco_operator.schema.quantity import is_quantity, quantity_bytes
from diloco_operator.schema.sync_memory import Budgets, SynchronizerMemory, budgets

# A StatefulSet's pods carry a `controller-revision-hash` label of `<name>-<10 chars>` (≤ 63).
MAX_STATEFULSET_NAME = 52
# The job's name names its Services: a DNS-1035 label (a custom resource's name may be a subdomain).

# The core's settings (``JobConfig``: "" for its own fields, or a section; "storage" for
# ``StorageSettings``) that have no CRD field under their own name, and why: (section, field) -> reason.
NO_CRD_FIELD: dict[tuple[str, str], str] = {
    ("", "job_id"): "set by metadata.name, or spec.synchronizer.external.jobId",
    ("train", "batch_size"): "set by spec.learnerUnits[].batchSize (each unit has its own)",
    ("train", "max_steps"): "set by spec.budget.steps (unlimited without a step budget)",
    ("storage", "url"): "set by spec.storage.bucket and spec.storage.prefix",
    ("storage", "endpoint_url"): "set by spec.storage.endpoint",
    ("storage", "keep_versions"): "not set by a job: the synchronizer keeps its own --keep-versions versions",
}


def crd_name(field: str) -> str:
    """A setting's name in the custom resource: camelCase, a ``_s`` unit spelled ``Seconds``."""
    return to_camel(field[: -len("_s")] + "_seconds" if field.endswith("_s") else field)


class SpecError(ValueError):
    """The spec can never work as written; the message says what to change."""


_SPEC_CONFIG = ConfigDict(alias_generator=crd_name, populate_by_name=True, extra="forbid", frozen=True)


class _Spec(BaseModel):
    model_config = _SPEC_CONFIG


class SecretKeyRef(_Spec):
    name: str = Field(..., min_length=1)
    key: str = Field(..., min_length=1)


class Images(_Spec):
    worker: str = Field(..., min_length=1)
    synchronizer: str = Field(..., min_length=1)
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"


class ModelSpec(ModelSettings):
    model_config = _SPEC_CONFIG


class DataSpec(DataSettings):
    model_config = _SPEC_CONFIG


class TrainSpec(TrainSettings):
    model_config = _SPEC_CONFIG

    # the worker's own setting (``compile_model``, ``DILOCO_COMPILE``), not the job's: it is not
    # written into the ConfigMap's JobConfig
    compile: bool = False

    @model_validator(mode="before")
    @classmethod
    def _refuse_settings_set_elsewhere(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for (section, name), reason in NO_CRD_FIELD.items():
                if section == "train" and (crd_name(name) in data or name in data):
                    raise ValueError(f"{crd_name(name)} is not a field of spec.train: it is {reason}")
        return data


class TrackingSpec(TrackingSettings):
    """Where learners and synchronizers send their figures; TensorBoard defaults to the job's storage
    (``<storage>/tensorboard``, see ``build.build_job_config``)."""

    model_config = _SPEC_CONFIG


class CredentialsRef(_Spec):
    name: str = Field(..., min_length=1)
    access_key_id_key: str = "AWS_ACCESS_KEY_ID"
    secret_access_key_key: str = "AWS_SECRET_ACCESS_KEY"  # noqa: S105 (a key name)


class StorageSpec(_Spec):
    endpoint: EndpointUrl | None = None
    bucket: str = Field(..., min_length=3, max_length=63)
    prefix: str = ""
    region: str | None = None
    credentials_secret_ref: CredentialsRef | None = None

    @property
    def url(self) -> str:
        prefix = self.prefix.strip("/")
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"


class DiLoCoSpec(DiLoCoSettings):
    model_config = _SPEC_CONFIG


def check_resources(resources: dict[str, Any]) -> dict[str, Any]:
    """``requests`` and ``limits`` of quantities (as a container's ``resources``); a bad one is named."""
    for part, values in resources.items():
        if part not in ("requests", "limits") or not isinstance(values, dict):
            raise ValueError(f"'{part}' is not one of requests, limits (each a map of quantities)")
        for name, value in values.items():
            if not is_quantity(value):
                raise ValueError(f"{part}.{name}: {value!r} is not a quantity (e.g. 500m, 2, 16Gi)")
    return resources


class LearnerPods(_Spec):
    """What every learner pod gets besides the operator's own (``pod_additions``): Kubernetes
    EnvVars, Volumes and VolumeMounts, taken as written."""

    env: list[dict[str, Any]] = Field(default_factory=list)
    volumes: list[dict[str, Any]] = Field(default_factory=list)
    volume_mounts: list[dict[str, Any]] = Field(default_factory=list)

    _env = field_validator("env")(pod_additions.check_env)
    _volumes = field_validator("volumes")(pod_additions.check_volumes)
    _mounts = field_validator("volume_mounts")(pod_additions.check_mounts)


class UnitTopology(_Spec):
    """Where Kueue's topology-aware scheduling puts a unit's pods: all in one domain of a level of
    the cluster's Kueue Topology (``required``), or in as few as it can (``preferred``). The level is
    the node label naming it, e.g. ``cloud.google.com/gce-topology-block`` or ``kubernetes.io/hostname``."""

    required: str | None = Field(None, min_length=1, max_length=316, pattern=LABEL_KEY)
    preferred: str | None = Field(None, min_length=1, max_length=316, pattern=LABEL_KEY)

    @model_validator(mode="after")
    def _one(self) -> UnitTopology:
        if (self.required is None) == (self.preferred is None):
            raise ValueError("set exactly one of required and preferred (a node label of a topology level)")
        return self


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
    tokens_per_step: int | None = Field(None, ge=1)
    # the fastest an inner step of this unit can be (its token declares it; beside the job's bound)
    min_step_time_seconds: float | None = Field(None, gt=0.0, le=MAX_STEP_S, allow_inf_nan=False)
    token_generation: int = Field(0, ge=0)
    # after spec.learners' (``pod_additions``)
    env: list[dict[str, Any]] = Field(default_factory=list)
    volumes: list[dict[str, Any]] = Field(default_factory=list)
    volume_mounts: list[dict[str, Any]] = Field(default_factory=list)
    pods: PodSettings | None = None  # over spec.pods
    topology: UnitTopology | None = None  # under a queue: Kueue's topology-aware scheduling

    _resources = field_validator("resources")(check_resources)
    _env = field_validator("env")(pod_additions.check_env)
    _volumes = field_validator("volumes")(pod_additions.check_volumes)
    _mounts = field_validator("volume_mounts")(pod_additions.check_mounts)


class ExternalSynchronizer(_Spec):
    url: str = Field(..., min_length=1)
    token_secret_ref: SecretKeyRef
    # The external synchronizer's job (its DiLoCoJob's name in the other cluster): the learners'
    # job config carries it, and the operator reads status only from a synchronizer serving it.
    job_id: str | None = Field(None, min_length=1, max_length=63)
    insecure: bool = False

    @model_validator(mode="after")
    def _tls_across_clusters(self) -> ExternalSynchronizer:
        if not self.url.lower().startswith("https://") and not self.insecure:
            raise ValueError(
                "synchronizer.external.url is reached from another cluster: it must be https:// "
                "(set synchronizer.external.insecure: true to send learner traffic in the clear)"
            )
        return self


class SynchronizerTLS(_Spec):
    """The synchronizer serves HTTPS with this Secret's ``tls.crt`` and ``tls.key``."""

    secret_name: str = Field(..., min_length=1)


class CABundle(_Spec):
    """Where learners and the operator find the CA bundle that an https synchronizer's certificate
    must chain to: a key of a Secret or of a ConfigMap."""

    secret_name: str | None = Field(None, min_length=1)
    config_map_name: str | None = Field(None, min_length=1)
    key: str = Field("ca.crt", min_length=1)

    @model_validator(mode="after")
    def _one_source(self) -> CABundle:
        if (self.secret_name is None) == (self.config_map_name is None):
            raise ValueError("synchronizer.ca takes secretName or configMapName, exactly one")
        return self


class SynchronizerSpec(_Spec):
    shards: int = Field(1, ge=1, le=64)
    resources: dict[str, Any] = Field(default_factory=dict)
    tls: SynchronizerTLS | None = None
    ca: CABundle | None = None
    external: ExternalSynchronizer | None = None
    token_lifetime_seconds: int = Field(86400, ge=600, le=366 * 86400)
    min_step_time_seconds: float = Field(0.0005, ge=0.0, le=3600.0)
    min_token_generations: dict[str, NonNegativeInt] = Field(default_factory=dict)
    env: list[dict[str, Any]] = Field(default_factory=list)  # after the operator's own
    pods: PodSettings | None = None  # over spec.pods
    memory: SynchronizerMemory | None = None

    _resources = field_validator("resources")(check_resources)
    _env = field_validator("env")(pod_additions.check_env)

    @model_validator(mode="after")
    def _memory_fits(self) -> SynchronizerSpec:
        _ = self.memory_budgets  # raises when the budgets do not fit in the memory limit
        return self

    @property
    def memory_budgets(self) -> Budgets:
        """The synchronizer's memory budgets: ``spec.synchronizer.memory``, else shares of its memory
        limit, else its defaults (``diloco_operator.schema.sync_memory``)."""
        limit = (self.resources.get("limits") or {}).get("memory")
        return budgets(self.memory, quantity_bytes(limit) if limit is not None else None)

    @model_validator(mode="after")
    def _tls_is_for_our_own(self) -> SynchronizerSpec:
        if self.tls is not None and self.external is not None:
            raise ValueError("synchronizer.tls is for a synchronizer this job runs, not with external")
        if self.ca is not None and not self.https:
            raise ValueError(
                "synchronizer.ca is for a synchronizer reached over HTTPS: set synchronizer.tls, or an "
                "https:// synchronizer.external.url"
            )
        return self

    @property
    def https(self) -> bool:
        """Whether the learners reach the synchronizer over HTTPS."""
        if self.external is not None:
            return self.external.url.lower().startswith("https://")
        return self.tls is not None


class Budget(_Spec):
    tokens: int | None = Field(None, ge=1)
    steps: int | None = Field(None, ge=1)


class ChaosSpec(_Spec):
    enabled: bool = False
    mtbf_seconds: float = Field(600.0, gt=0.0)
    repair_seconds: float = Field(0.0, ge=0.0)
    units: list[str] = Field(default_factory=list)


class ExportSpec(_Spec):
    """The model taken out when the job Succeeded (``export``): a Job in the worker image."""

    enabled: bool = True
    resources: dict[str, Any] = Field(default_factory=dict)

    _resources = field_validator("resources")(check_resources)


class DiLoCoJobSpec(_Spec):
    images: Images
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    train: TrainSpec = TrainSpec()
    storage: StorageSpec
    diloco: DiLoCoSpec = DiLoCoSpec()
    tracking: TrackingSpec = TrackingSpec()
    learners: LearnerPods = LearnerPods()
    learner_units: list[LearnerUnit] = Field(..., min_length=1)
    synchronizer: SynchronizerSpec = SynchronizerSpec()
    budget: Budget = Budget()
    suspend: bool = False
    unit_lost_after_seconds: float = Field(300.0, gt=0.0)
    chaos: ChaosSpec = ChaosSpec()
    export: ExportSpec = ExportSpec()
    pods: PodSettings = PodSettings()  # every pod of the job (pod_settings)
    # Kueue: each learner unit a workload of its own in this LocalQueue, at this WorkloadPriorityClass
    queue_name: str | None = Field(None, min_length=1, max_length=63, pattern=LABEL_VALUE)
    workload_priority_class_name: str | None = Field(None, min_length=1, max_length=63, pattern=LABEL_VALUE)


def parse_spec(spec: dict[str, Any]) -> DiLoCoJobSpec:
    """Parse the custom resource's spec; raise SpecError naming every offending field."""
    try:
        return DiLoCoJobSpec.model_validate(spec)
    except ValidationError as exc:
        raise SpecError(describe_errors(exc.errors(), lambda loc: dotted(("spec", *loc)))) from None


def validate_job(name: str, spec: DiLoCoJobSpec) -> None:
    """Checks the schema cannot express; raise SpecError with what to change."""
    d = spec.diloco  # overlap < innerSteps: checked by the settings themselves (parse_spec)
    names = [u.name for u in spec.learner_units]
    problems = name_problems(
        name, names, spec.synchronizer.shards, external=spec.synchronizer.external is not None
    )
    if problems:
        raise SpecError("; ".join(problems))
    parked = [u.name for u in spec.learner_units if u.replicas == 0]  # never ready: no quorum
    running = len(names) - len(parked)
    if d.quorum > running:
        not_counted = f", not counting {', '.join(parked)}: replicas 0, never ready" if parked else ""
        raise SpecError(
            f"spec.diloco.quorum ({d.quorum}) exceeds the number of learner units ({running}{not_counted}); "
            "lower the quorum or add units"
        )
    shards = spec.synchronizer.shards
    if spec.synchronizer.external is None and shards > d.fragments:
        raise SpecError(
            f"spec.synchronizer.shards ({shards}) must be at most spec.diloco.fragments ({d.fragments}): "
            "a shard owns the fragments p with p % shards equal to its index, so a shard past the "
            "fragments would own none; lower the shards or raise the fragments"
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
    job = spec.learners
    problems = [
        problem
        for i, unit in enumerate(spec.learner_units)
        for problem in pod_additions.unit_problems(
            f"spec.learnerUnits[{i}] ({unit.name})",
            [*job.volumes, *unit.volumes],
            [*job.volume_mounts, *unit.volume_mounts],
        )
    ]
    if problems:
        raise SpecError("; ".join(problems))


def unit_pod_settings(spec: DiLoCoJobSpec, unit: LearnerUnit) -> PodSettings:
    return merged(spec.pods, unit.pods)


def sync_pod_settings(spec: DiLoCoJobSpec) -> PodSettings:
    return merged(spec.pods, spec.synchronizer.pods)
