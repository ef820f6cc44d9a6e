"""Level-based reconciliation of one job: desired children in, applied children and a status out.

Shared by the create/update/resume handlers and the drift-repair timer. The decisions are the
pure builders (``children``, ``status``, ``chaos``); this module only reads and writes.
"""

from __future__ import annotations

import base64
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from diloco_core.auth import new_job_secret
from diloco_core.protocol import StatusResponse

from diloco_operator import chaos, status
from diloco_operator.build import JOB_LABEL, JobRef, build_secret, job_id, secret_name, sync_name, sync_url
from diloco_operator.children import build_children
from diloco_operator.job_status import ChaosStatus, JobStatus
from diloco_operator.kube import Kube, is_subset
from diloco_operator.models import (
    CABundle,
    DiLoCoJobSpec,
    SpecError,
    config_map_references,
    parse_spec,
    secret_references,
    validate_job,
)
from diloco_operator.status import Event

log = logging.getLogger(__name__)

StatusFetcher = Callable[[str, str | None], StatusResponse | None]  # (URL, CA bundle PEM or None)
PRUNED_KINDS = (("apps/v1", "StatefulSet"), ("policy/v1", "PodDisruptionBudget"), ("v1", "Service"),
                ("apps/v1", "Deployment"))


@dataclass
class Outcome:
    status: JobStatus
    events: list[Event] = field(default_factory=list)
    created: int = 0
    repaired: int = 0
    deleted: int = 0
    invalid: str | None = None


def check_spec(kube: Kube, job: JobRef, raw: Mapping[str, Any]) -> DiLoCoJobSpec:
    """Parse, validate and check the references of the spec; SpecError says what is wrong."""
    spec = parse_spec(dict(raw))
    validate_job(job.name, spec)
    for kind, references in (("Secret", secret_references(spec)), ("ConfigMap", config_map_references(spec))):
        for name, key in references:
            found = kube.get("v1", kind, job.namespace, name)
            if found is None:
                raise SpecError(f"{kind} '{name}' referenced by the spec does not exist in namespace {job.namespace}")
            if key not in (found.get("data") or {}):
                raise SpecError(f"{kind} '{name}' has no key '{key}' that the spec refers to")
    return spec


def read_ca_bundle(kube: Kube, namespace: str, ca: CABundle | None) -> str | None:
    """The PEM text of the synchronizer's CA bundle that the spec names (None: none named, or gone)."""
    if ca is None:
        return None
    if ca.secret_name is not None:
        data = (kube.get("v1", "Secret", namespace, ca.secret_name) or {}).get("data") or {}
        return base64.b64decode(data[ca.key]).decode(errors="replace") if ca.key in data else None
    assert ca.config_map_name is not None
    value = ((kube.get("v1", "ConfigMap", namespace, ca.config_map_name) or {}).get("data") or {}).get(ca.key)
    return str(value) if value is not None else None


def ensure_secret(kube: Kube, job: JobRef, spec: DiLoCoJobSpec) -> int:
    """Create the job secret once; an existing one is never replaced (tokens stay valid)."""
    if spec.synchronizer.external is not None:
        return 0
    if kube.get("v1", "Secret", job.namespace, secret_name(job.name)) is not None:
        return 0
    return 1 if kube.create(build_secret(job, new_job_secret())) is not None else 0


def apply_children(kube: Kube, desired: list[dict[str, Any]], outcome: Outcome) -> dict[str, dict[str, Any]]:
    """Create what is missing, put back what drifted; returns the actual objects by kind/name."""
    actual_by_key: dict[str, dict[str, Any]] = {}
    for obj in desired:
        meta = obj["metadata"]
        actual = kube.get(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        if actual is None:
            actual = kube.apply(obj)
            outcome.created += 1
            log.info("created %s %s", obj["kind"], meta["name"])
        elif not is_subset(obj, actual):
            actual = kube.apply(obj)
            outcome.repaired += 1
            log.info("restored %s %s", obj["kind"], meta["name"])
        actual_by_key[f"{obj['kind']}/{meta['name']}"] = actual
    return actual_by_key


def prune(kube: Kube, job: JobRef, keep: set[str], outcome: Outcome) -> None:
    """Delete our children that the spec no longer asks for (a removed unit, fewer shards)."""
    for api_version, kind in PRUNED_KINDS:
        for obj in kube.list(api_version, kind, job.namespace, {JOB_LABEL: job.name}):
            owners = obj["metadata"].get("ownerReferences") or []
            if f"{kind}/{obj['metadata']['name']}" in keep or not any(o.get("uid") == job.uid for o in owners):
                continue
            if kube.delete(api_version, kind, job.namespace, obj["metadata"]["name"]):
                outcome.deleted += 1
                log.info("deleted %s %s", kind, obj["metadata"]["name"])


def observe(spec: DiLoCoJobSpec, job: JobRef, actual: Mapping[str, dict[str, Any]]) -> tuple[list[status.UnitObserved], bool]:
    units = []
    for unit in spec.learner_units:
        sts = actual.get(f"StatefulSet/{job.name}-{unit.name}") or {}
        st = sts.get("status") or {}
        units.append(status.UnitObserved(unit.name, int(st.get("replicas") or 0), int(st.get("readyReplicas") or 0)))
    sync_ready = all(
        int(((actual.get(f"Deployment/{sync_name(job.name, i)}") or {}).get("status") or {}).get("availableReplicas") or 0) >= 1
        for i in range(spec.synchronizer.shards)
    )
    return units, sync_ready


def chaos_state(old: JobStatus, now: float) -> tuple[int, dict[str, float]]:
    c = old.chaos or ChaosStatus()
    down = {k: float(v) for k, v in c.down_until.items() if v is not None}
    return c.kills, chaos.repaired(down, now)


def run_chaos(
    kube: Kube, job: JobRef, spec: DiLoCoJobSpec, old: JobStatus, now: float, rng: random.Random
) -> tuple[list[chaos.Victim], dict[str, float]]:
    """Kill the pods chaos picks (grace 0, like a crash); returns the victims and units under repair."""
    _, down = chaos_state(old, now)
    units = chaos.chaos_units(spec.chaos, spec, down)
    if not units:
        return [], down
    last_tick = (old.chaos.last_tick if old.chaos else None) or now
    pods = [
        chaos.PodRef(p["metadata"]["name"], p["metadata"].get("labels", {}).get("diloco.dev/unit", ""),
                     (p.get("status") or {}).get("phase") == "Running")
        for p in kube.list("v1", "Pod", job.namespace, {JOB_LABEL: job.name, "app.kubernetes.io/component": "learner"})
    ]
    victims = chaos.pick_victims(units, pods, now, rng, last_tick=last_tick)
    for v in victims:
        kube.delete("v1", "Pod", job.namespace, v.pod, grace=0)
        if spec.chaos.repair_seconds > 0:
            down[v.unit] = now + spec.chaos.repair_seconds
    return victims, down


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


def reconcile(
    kube: Kube,
    job: JobRef,
    raw_spec: Mapping[str, Any],
    old: JobStatus,
    *,
    now: datetime,
    fetch: StatusFetcher,
    generation: int | None = None,
    sync_url_override: str | None = None,
    rng: random.Random | None = None,
    allow_chaos: bool = False,
) -> Outcome:
    """Bring the job's children to the spec and compute its status.

    With ``rng`` (the timer), built-in chaos runs first when the operator allows it
    (``allow_chaos``) and the spec enables it. An invalid spec creates nothing and yields a
    ``Failed`` status with the reason in ``outcome.invalid``.
    """
    try:
        spec = check_spec(kube, job, raw_spec)
    except SpecError as exc:
        new = status.invalid_status(str(exc), old, now, generation)
        events = [] if old.phase == "Failed" and old.message == str(exc) else [
            status.Event("Warning", "InvalidSpec", str(exc))]
        return Outcome(new, events, invalid=str(exc))
    epoch = now.timestamp()
    kills, down = chaos_state(old, epoch)
    victims: list[chaos.Victim] = []
    gate = chaos.chaos_gate(spec.chaos, allow_chaos)
    active = gate is not None and gate.active
    if rng is not None and active and not spec.suspend:
        victims, down = run_chaos(kube, job, spec, old, epoch, rng)
    outcome = Outcome(JobStatus())
    outcome.created += ensure_secret(kube, job, spec)
    desired = build_children(job, spec, learners_stopped=old.phase == "Succeeded",
                             down_units=frozenset(down))
    actual = apply_children(kube, desired, outcome)
    prune(kube, job, set(actual), outcome)
    units, sync_ready = observe(spec, job, actual)
    url = sync_url_override.format(name=job.name, namespace=job.namespace) if sync_url_override else sync_url(job, spec)
    reachable = sync_ready or spec.synchronizer.external is not None or sync_url_override
    sync = fetch(url, read_ca_bundle(kube, job.namespace, spec.synchronizer.ca)) if reachable else None
    problem = wrong_job(sync, job, spec, url)
    if problem:
        sync = None
    if spec.synchronizer.external is not None or problem:
        sync_ready = sync is not None
    obs = status.Observed(units, sync_ready, sync, kills + len(victims), down, job=job.name, sync_problem=problem)
    new = status.compute_status(spec, obs, old, now, generation)
    old_down = old.chaos.down_until if old.chaos else {}
    chaos_status = ChaosStatus(
        kills=obs.chaos_kills,
        down_until={k: down.get(k) for k in {*old_down, *down}},  # None removes (merge patch)
        last_tick=epoch if active else None,
    )
    conditions = new.conditions
    if gate is not None:
        conditions += (status.condition(old.conditions, "Chaos", gate.active, gate.reason, gate.message, now),)
    new = new.model_copy(update={"message": None, "chaos": chaos_status, "conditions": conditions})
    outcome.status = new
    outcome.events = [status.Event("Warning", "ChaosKill", f"chaos killed pod {v.pod} of unit {v.unit}")
                      for v in victims]
    outcome.events += status.diff_events(old, new)
    if gate is not None:
        outcome.events += gate_events(old, gate)
    return outcome


def gate_events(old: JobStatus, gate: chaos.Gate) -> list[status.Event]:
    """A Warning when chaos is newly refused (or refused for another reason than before)."""
    before = c.reason if (c := old.condition("Chaos")) else None
    if gate.reason in chaos.GATE_EVENTS and gate.reason != before:
        return [status.Event("Warning", chaos.GATE_EVENTS[gate.reason], gate.message)]
    return []
