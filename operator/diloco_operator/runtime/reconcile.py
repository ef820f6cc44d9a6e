"""Level-based reconciliation of one job's children: the desired children in, applied children out.

The decisions are the pure builders (``children``, ``chaos``); this module only reads and writes.
A reconcile never runs beside another one of the same job (``jobs.JobWorker``); within it, the
children are applied a bounded number at a time. Before anything of a new spec generation is
written, the apiserver validates the children a dry run at a time (one per distinct pod template):
a spec that passes the CRD's schema but makes an invalid pod (a toleration's operator misspelt, say)
fails with the apiserver's message and creates nothing (nor deletes a unit that its queue would
have it make anew).
"""

from __future__ import annotations

import base64
import json
import logging
import random
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from diloco_core.auth import mint_token, new_job_secret
from diloco_core.protocol import StatusResponse
from kubernetes.client.exceptions import ApiException

from diloco_operator.builders.children import build_children
from diloco_operator.builders.credentials import build_learner_token_secret, build_secret
from diloco_operator.builders.env import JOB_SECRET_KEY
from diloco_operator.builders.names import (
    JOB_LABEL,
    UNIT_LABEL,
    JobRef,
    job_id,
    learner_token_secret_name,
    secret_name,
    unit_name,
)
from diloco_operator.builders.network import SyncIngress
from diloco_operator.builders.tokens import claim_annotations, mint_reason, unit_claims
from diloco_operator.kube import Kube, api_error, is_subset
from diloco_operator.runtime import chaos
from diloco_operator.runtime.queue import queue_locked_change
from diloco_operator.schema.spec import (
    CABundle,
    DiLoCoJobSpec,
    SpecError,
)
from diloco_operator.settings import OperatorSettings
from diloco_operator.status.admission import WORKLOAD_API, Admission, unit_admissions
from diloco_operator.status.events import Event

log = logging.getLogger(__name__)

StatusFetcher = Callable[[str, str | None], StatusResponse | None]  # (URL, CA bundle PEM or None)
PRUNED_KINDS = (
    ("apps/v1", "StatefulSet"),
    ("policy/v1", "PodDisruptionBudget"),
    ("v1", "Service"),
    ("apps/v1", "Deployment"),
    ("batch/v1", "Job"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
)
# Children whose content comes partly from free-form fields of the spec (resources, tolerations,
# affinity, node selectors): the apiserver validates them by a dry run before anything is applied.
VALIDATED_KINDS = ("StatefulSet", "Deployment")
# Client errors that mean "this object can never be stored as built", not "try again".
INVALID = (400, 422)


@dataclass
class Outcome:
    events: list[Event] = field(default_factory=list)
    created: int = 0
    repaired: int = 0
    deleted: int = 0
    victims: list[chaos.Victim] = field(default_factory=list)
    down: dict[str, float] = field(default_factory=dict)  # units under chaos repair until (epoch s)


def sync_ingress(settings: OperatorSettings) -> SyncIngress | None:
    """Who the synchronizers' own NetworkPolicies admit besides their learners (None: no policies)."""
    return SyncIngress(settings.operator_namespace) if settings.sync_network_policy else None


def read_admissions(kube: Kube, job: JobRef, spec: DiLoCoJobSpec) -> dict[str, Admission]:
    """Each unit's admission by Kueue, from the namespace's Workloads (none without a queue)."""
    if not spec.queue_name:
        return {}
    workloads = kube.list(WORKLOAD_API, "Workload", job.namespace, {})
    return unit_admissions(workloads, {u.name: unit_name(job.name, u.name) for u in spec.learner_units})


def secret_value(kube: Kube, namespace: str, name: str, key: str) -> str | None:
    """The text under ``key`` of a Secret (None: the Secret or the key is gone)."""
    data = (kube.get("v1", "Secret", namespace, name) or {}).get("data") or {}
    return base64.b64decode(data[key]).decode(errors="replace") if key in data else None


def read_ca_bundle(kube: Kube, namespace: str, ca: CABundle | None) -> str | None:
    """The PEM text of the synchronizer's CA bundle that the spec names (None: none named, or gone)."""
    if ca is None:
        return None
    if ca.secret_name is not None:
        return secret_value(kube, namespace, ca.secret_name, ca.key)
    assert ca.config_map_name is not None
    value = ((kube.get("v1", "ConfigMap", namespace, ca.config_map_name) or {}).get("data") or {}).get(ca.key)
    return str(value) if value is not None else None


def validation_sample(desired: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One child per distinct pod spec among the kinds a dry run validates (a hundred identical
    units need one dry run, not a hundred)."""
    seen: set[str] = set()
    sample = []
    for obj in desired:
        if obj["kind"] not in VALIDATED_KINDS:
            continue
        pod = json.loads(json.dumps(obj["spec"]["template"]["spec"]))
        for container in pod.get("containers", []):
            container.pop("env", None)  # names and ordinals only
        for volume in pod.get("volumes", []):
            secret = volume.get("secret") if isinstance(volume, dict) else None
            if isinstance(secret, dict):
                secret.pop("secretName", None)  # the unit's own token Secret
        key = json.dumps([obj["kind"], pod], sort_keys=True)
        if key not in seen:
            seen.add(key)
            sample.append(obj)
    return sample


def queue_locked(desired: list[dict[str, Any]], listed: dict[str, dict[str, Any]]) -> dict[str, str]:
    """``Kind/name`` -> what changed, of each unit's StatefulSet that its queue's Kueue would not let
    change in place (``queue.queue_locked_change``): it is deleted and created anew."""
    locked = {}
    for obj in desired:
        key = f"{obj['kind']}/{obj['metadata']['name']}"
        why = queue_locked_change(obj, listed.get(key)) if obj["kind"] == "StatefulSet" else None
        if why is not None:
            locked[key] = why
    return locked


def dry_run_form(obj: dict[str, Any], locked: Mapping[str, str]) -> dict[str, Any]:
    """The object a dry run validates: ``obj`` itself, or, for a queue-locked StatefulSet, ``obj``
    scaled to zero (the one in-place change Kueue admits; the pod template is validated all the same)."""
    if f"{obj['kind']}/{obj['metadata']['name']}" not in locked:
        return obj
    return {**obj, "spec": {**obj["spec"], "replicas": 0}}


def validate_children(
    kube: Kube, desired: list[dict[str, Any]], locked: Mapping[str, str] | None = None
) -> None:
    """Dry-run apply of ``validation_sample(desired)``; SpecError with the apiserver's reason.
    ``locked``: see ``queue_locked``; those are validated as ``dry_run_form`` makes them."""
    for obj in validation_sample(desired):
        try:
            kube.apply(dry_run_form(obj, locked or {}), dry_run=True)
        except ApiException as exc:
            if exc.status in INVALID:
                raise SpecError(
                    f"the spec makes an invalid {obj['kind']} {obj['metadata']['name']}: " f"{api_error(exc)}"
                ) from None
            raise


def ensure_secret(kube: Kube, job: JobRef, spec: DiLoCoJobSpec) -> int:
    """Create the job secret once; an existing one is never replaced (tokens stay valid)."""
    if spec.synchronizer.external is not None:
        return 0
    if kube.get("v1", "Secret", job.namespace, secret_name(job.name)) is not None:
        return 0
    return 1 if kube.create(build_secret(job, new_job_secret())) is not None else 0


def ensure_learner_tokens(kube: Kube, job: JobRef, spec: DiLoCoJobSpec, now: int) -> int:
    """Mint each unit's learner token into its Secret where ``tokens.mint_reason`` says so (missing,
    another generation or tokens per step, or half its life gone), from the job secret (the job's
    own, or the external synchronizer's): the only credential the unit's pods get. Each unit's Secret
    is read by name (a GET: the operator may not list Secrets). Returns how many were minted."""
    external = spec.synchronizer.external
    ref = (
        (external.token_secret_ref.name, external.token_secret_ref.key)
        if external is not None
        else (secret_name(job.name), JOB_SECRET_KEY)
    )
    job_secret: str | None = None
    minted = 0
    for unit in spec.learner_units:
        name = learner_token_secret_name(job.name, unit.name)
        wanted = unit_claims(job, spec, unit, now)
        reason = mint_reason(kube.get("v1", "Secret", job.namespace, name), wanted, now)
        if reason is None:
            continue
        job_secret = job_secret or secret_value(kube, job.namespace, *ref)
        if not job_secret:  # the referenced Secret is gone: the spec check says so
            return minted
        kube.apply(
            build_learner_token_secret(
                job, unit.name, mint_token(job_secret, wanted), claim_annotations(wanted)
            )
        )
        minted += 1
        log.info(
            "minted the learner token of unit %s (%s), valid until %s", unit.name, reason, wanted.expires_at
        )
    return minted


def list_children(kube: Kube, job: JobRef) -> dict[str, dict[str, Any]]:
    """The job's children of the kinds a reconcile may prune, by ``Kind/name``: one LIST per kind
    (not a GET per child: a hundred units are four requests)."""
    out: dict[str, dict[str, Any]] = {}
    for api_version, kind in PRUNED_KINDS:
        for obj in kube.list(api_version, kind, job.namespace, {JOB_LABEL: job.name}):
            out[f"{kind}/{obj['metadata']['name']}"] = obj
    return out


def apply_one(kube: Kube, obj: dict[str, Any], current: dict[str, Any] | None) -> str | None:
    """Create the child if it is missing, put it back if it drifted from ``current`` (as listed):
    "created", "restored" or None."""
    if current is not None and is_subset(obj, current):
        return None
    meta = obj["metadata"]
    try:
        kube.apply(obj)
    except ApiException as exc:
        if exc.status in INVALID:
            raise SpecError(
                f"the spec makes an invalid {obj['kind']} {meta['name']}: {api_error(exc)}"
            ) from None
        raise
    action = "created" if current is None else "restored"
    log.info("%s %s %s", action, obj["kind"], meta["name"])
    return action


def apply_children(
    kube: Kube,
    job: JobRef,
    desired: list[dict[str, Any]],
    listed: dict[str, dict[str, Any]],
    outcome: Outcome,
    pool: ThreadPoolExecutor,
) -> None:
    """Apply every child that is missing or drifted (the job's ConfigMap first: every pod mounts
    it), the rest ``pool``'s workers at a time."""

    def current(obj: dict[str, Any]) -> dict[str, Any] | None:
        key = f"{obj['kind']}/{obj['metadata']['name']}"
        if key in listed or any(kind == obj["kind"] for _, kind in PRUNED_KINDS):
            return listed.get(key)
        return kube.get(obj["apiVersion"], obj["kind"], job.namespace, obj["metadata"]["name"])

    first, rest = desired[:1], desired[1:]
    actions = [apply_one(kube, obj, current(obj)) for obj in first]
    actions += list(pool.map(lambda obj: apply_one(kube, obj, current(obj)), rest))
    outcome.created += actions.count("created")
    outcome.repaired += actions.count("restored")


def recreate_queue_locked(
    kube: Kube, job: JobRef, locked: Mapping[str, str], listed: dict[str, dict[str, Any]]
) -> None:
    """Delete each unit's StatefulSet in ``locked`` (see ``queue_locked``); it is created anew below
    and queued as a new workload."""
    for key, why in locked.items():
        name = key.split("/", 1)[1]
        if kube.delete("apps/v1", "StatefulSet", job.namespace, name):
            log.info(
                "job %s/%s: StatefulSet %s is created anew under its queue: %s changed",
                job.namespace,
                job.name,
                name,
                why,
            )
        listed.pop(key, None)


def prune(
    kube: Kube, job: JobRef, keep: set[str], listed: dict[str, dict[str, Any]], outcome: Outcome
) -> None:
    """Delete our children that the spec no longer asks for (a removed unit, fewer shards)."""
    for key, obj in listed.items():
        kind, name = key.split("/", 1)
        owners = obj["metadata"].get("ownerReferences") or []
        if key in keep or not any(o.get("uid") == job.uid for o in owners):
            continue
        if kube.delete(obj["apiVersion"], kind, job.namespace, name):
            outcome.deleted += 1
            log.info("deleted %s %s", kind, name)
        unit = (obj["metadata"].get("labels") or {}).get(UNIT_LABEL)
        token = learner_token_secret_name(job.name, unit) if kind == "StatefulSet" and unit else None
        if token is not None and kube.delete("v1", "Secret", job.namespace, token):
            outcome.deleted += 1  # the removed unit's token goes with it
            log.info("deleted Secret %s", token)


def run_chaos(
    kube: Kube,
    job: JobRef,
    spec: DiLoCoJobSpec,
    down: dict[str, float],
    last_tick: float,
    now: float,
    rng: random.Random,
) -> tuple[list[chaos.Victim], dict[str, float]]:
    """Kill the pods chaos picks (grace 0, like a crash); returns the victims and units under repair."""
    units = chaos.chaos_units(spec.chaos, spec, down)
    if not units:
        return [], down
    pods = [
        chaos.PodRef(
            p["metadata"]["name"],
            p["metadata"].get("labels", {}).get(UNIT_LABEL, ""),
            (p.get("status") or {}).get("phase") == "Running",
        )
        for p in kube.list(
            "v1", "Pod", job.namespace, {JOB_LABEL: job.name, "app.kubernetes.io/component": "learner"}
        )
    ]
    victims = chaos.pick_victims(units, pods, now, rng, last_tick=last_tick)
    down = dict(down)
    for v in victims:
        kube.delete("v1", "Pod", job.namespace, v.pod, grace=0)
        if spec.chaos.repair_seconds > 0:
            down[v.unit] = now + spec.chaos.repair_seconds
    return victims, down


def reconcile_children(
    kube: Kube,
    job: JobRef,
    spec: DiLoCoJobSpec,
    *,
    validate: bool,
    learners_stopped: bool,
    down: dict[str, float],
    pool: ThreadPoolExecutor,
    ingress: SyncIngress | None = None,
) -> tuple[Outcome, list[dict[str, Any]]]:
    """Bring the job's children to the spec (``down``: units chaos keeps scaled to zero); returns
    what was done and the desired children. ``validate``: dry-run the children first (a new
    spec generation). ``ingress``: see ``sync_ingress``. SpecError when the apiserver refuses a
    child as built."""
    desired = build_children(
        job, spec, learners_stopped=learners_stopped, down_units=frozenset(down), ingress=ingress
    )
    listed = list_children(kube, job)
    locked = queue_locked(desired, listed)
    if validate:  # before anything is deleted: a refused spec leaves the running units as they are
        validate_children(kube, desired, locked)
    recreate_queue_locked(kube, job, locked, listed)
    outcome = Outcome(down=dict(down))
    outcome.created += ensure_secret(kube, job, spec)
    outcome.created += ensure_learner_tokens(kube, job, spec, int(time.time()))
    apply_children(kube, job, desired, listed, outcome, pool)
    prune(kube, job, {f"{obj['kind']}/{obj['metadata']['name']}" for obj in desired}, listed, outcome)
    return outcome, desired


def wrong_job(sync: StatusResponse | None, job: JobRef, spec: DiLoCoJobSpec, url: str) -> str | None:
    """Why the synchronizer's status must not be used: it serves another job (None: it may be used).

    An external synchronizer without ``jobId`` is not checked (its job id is then unknown here).
    """
    external = spec.synchronizer.external
    if sync is None or (external is not None and not external.job_id):
        return None
    expected = job_id(job, spec)
    if sync.job_id == expected:
        return None
    return f"the synchronizer at {url} serves job '{sync.job_id}', not '{expected}'"
