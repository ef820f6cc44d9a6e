"""One pass over a job: reconcile its children when asked, then refresh its status from the watches.

A pass runs in a thread, never beside another pass of the same job (``jobs.JobWorker``). The status
is computed from the job's pods as the pod watch delivered them (``pods.PodCache``), from what the
last reconcile learnt from the synchronizer, and from the status this operator last wrote; it is
written (a JSON merge patch of the status subresource) only when it changed. So the status follows
the pods within a debounce and a patch, and never goes back to an older view.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from diloco_operator.builders.names import API_VERSION, KIND, TEMPLATE_HASH_ANNOTATION, JobRef, sync_url
from diloco_operator.kube import Kube, api_error
from diloco_operator.runtime import chaos
from diloco_operator.runtime.checks import check_spec
from diloco_operator.runtime.jobs import JobState, Request, SyncView
from diloco_operator.runtime.liveness import WatchState
from diloco_operator.runtime.metrics import OperatorMetrics
from diloco_operator.runtime.pods import (
    PodCache,
    PodWatch,
    Restart,
    outdated_pods,
    restarting_into,
    restarts_under_way,
    sync_image_problem,
    sync_observation,
    sync_storage_conflict,
    unit_observations,
)
from diloco_operator.runtime.queue import with_job_queue
from diloco_operator.runtime.reconcile import (
    StatusFetcher,
    read_admissions,
    read_ca_bundle,
    reconcile_children,
    run_chaos,
    sync_ingress,
    wrong_job,
)
from diloco_operator.runtime.rollout import failing_units, plan_rollout, rollout_condition
from diloco_operator.runtime.syncstatus import redacted_url
from diloco_operator.schema.spec import DiLoCoJobSpec, SpecError, parse_spec, validate_job
from diloco_operator.schema.status import ChaosStatus, JobStatus
from diloco_operator.settings import OperatorSettings
from diloco_operator.status.admission import Admission
from diloco_operator.status.conditions import condition
from diloco_operator.status.events import Event, diff_events, event_object
from diloco_operator.status.export import export_events, job_export
from diloco_operator.status.job import Observed, compute_status, invalid_status
from diloco_operator.status.pods import PodObserved
from diloco_operator.status.units import unit_state_counts

log = logging.getLogger(__name__)


@dataclass
class Context:
    """Everything the passes and handlers share, built once at start-up (kept in kopf's memo)."""

    settings: OperatorSettings
    kube: Kube
    fetch: StatusFetcher
    metrics: OperatorMetrics
    rng: random.Random
    pods: PodCache
    losses: PodWatch
    watch: WatchState
    namespaces: list[str]  # the namespaces watched; empty: all
    pool: ThreadPoolExecutor  # applies a job's children, settings.apply_concurrency at a time
    instance: str  # reported as the events' reportingInstance (in a pod: its name)


def post_events(kube: Kube, job: dict[str, Any], events: list[Event], instance: str) -> None:
    """Post each event about ``job`` now (one that cannot be posted is logged, never fatal)."""
    now = datetime.now(UTC)
    for ev in events:
        try:
            kube.create(event_object(job, ev, now, instance))
        except Exception as exc:  # (events are auxiliary: never fail a pass for one)
            log.warning(
                "could not post event %s %s on %s: %s",
                ev.type,
                ev.reason,
                job["metadata"].get("name"),
                api_error(exc),
            )


def write_status(ctx: Context, state: JobState, new: JobStatus, events: list[Event]) -> None:
    """Write the status if it changed (always once after start-up), post its events, update the metrics."""
    old = state.current_status()
    job = state.ref
    patch = new.to_patch()
    after = old.merged(patch)
    if (state.status is None or after != old) and not ctx.kube.patch_status(
        API_VERSION, KIND, job.namespace, job.name, patch
    ):
        return  # the job is gone
    state.status = after
    post_events(ctx.kube, state.body, events, ctx.instance)
    ctx.metrics.set_phase(job.namespace, job.name, str(state.status.phase))
    ctx.metrics.set_units(job.namespace, job.name, unit_state_counts(state.status))


def invalid(ctx: Context, state: JobState, problem: str, generation: int | None) -> None:
    """The spec can never work: a Failed status saying why, and one event (not one per pass)."""
    old = state.current_status()
    new = invalid_status(problem, old, datetime.now(UTC), generation)
    same = old.phase == "Failed" and old.message == problem
    write_status(ctx, state, new, [] if same else [Event("Warning", "InvalidSpec", problem)])
    if not same:
        log.warning("job %s/%s: invalid spec: %s", state.ref.namespace, state.ref.name, problem)


def reconcile(ctx: Context, state: JobState, spec: DiLoCoJobSpec, req: Request, now: datetime) -> list[Event]:
    """Apply the children (and chaos, on the timer); remember what the status passes need."""
    job, old = state.ref, state.current_status()
    generation = state.body["metadata"].get("generation")
    epoch = now.timestamp()
    previous = state.chaos or old.chaos or ChaosStatus()
    down = chaos.repaired({k: float(v) for k, v in previous.down_until.items() if v is not None}, epoch)
    gate = chaos.chaos_gate(spec.chaos, ctx.settings.allow_chaos)
    active = gate is not None and gate.active
    victims: list[chaos.Victim] = []
    if req.chaos and active and not spec.suspend:
        victims, down = run_chaos(ctx.kube, job, spec, down, previous.last_tick or epoch, epoch, ctx.rng)
    stopped = old.phase == "Succeeded"
    outcome, desired = reconcile_children(
        ctx.kube,
        job,
        spec,
        validate=state.validated_generation != generation,
        learners_stopped=stopped,
        down=down,
        pool=ctx.pool,
        ingress=sync_ingress(ctx.settings),
    )
    state.validated_generation = state.reconciled_generation = generation
    state.learners_stopped = stopped
    state.templates = {
        obj["metadata"]["labels"]["diloco.dev/unit"]: obj["spec"]["template"]["metadata"]["annotations"][
            TEMPLATE_HASH_ANNOTATION
        ]
        for obj in desired
        if obj["kind"] == "StatefulSet"
    }
    state.chaos = ChaosStatus(
        kills=previous.kills + len(victims),
        down_until={k: down.get(k) for k in {*previous.down_until, *down}},  # None removes (merge patch)
        last_tick=epoch if active else None,
    )
    for action, n in (
        ("created", outcome.created),
        ("restored", outcome.repaired),
        ("deleted", outcome.deleted),
    ):
        if n:
            ctx.metrics.children.labels(action).inc(n)
    ctx.metrics.chaos_kills.inc(len(victims))
    return [Event("Warning", "ChaosKill", f"chaos killed pod {v.pod} of unit {v.unit}") for v in victims]


def read_synchronizer(
    fetch: StatusFetcher,
    override: str | None,
    job: JobRef,
    spec: DiLoCoJobSpec,
    sync_ready: bool,
    ca_pem: str | None,
) -> SyncView:
    """The synchronizer's answer, from its in-cluster URL or ``override`` (``--sync-url``, with
    ``{name}`` and ``{namespace}`` replaced by the job's), an https one checked against ``ca_pem``;
    asked only when it can answer. An external synchronizer's answer decides its readiness: the URL
    that gave none is kept for the status's message."""
    url = override.format(name=job.name, namespace=job.namespace) if override else sync_url(job, spec)
    external = spec.synchronizer.external is not None
    asked = sync_ready or external or bool(override)
    sync = fetch(url, ca_pem) if asked else None
    shown = redacted_url(url)
    problem = wrong_job(sync, job, spec, shown)
    if problem:
        sync = None
    ready = (sync is not None) if (external or problem) else None
    return SyncView(sync, problem, ready, shown if external and sync is None and not problem else "")


def observation(
    spec: DiLoCoJobSpec,
    job: str,
    pods: list[PodObserved],
    view: SyncView,
    chaos_status: ChaosStatus,
    restarting: frozenset[str] = frozenset(),
    admissions: Mapping[str, Admission] | None = None,
) -> Observed:
    """What the status is computed from: the job's pods as the watch saw them, the synchronizer's
    last answer (``view``), the chaos bookkeeping and the units the operator is restarting."""
    pods_sync_ready, sync_unschedulable = sync_observation(spec, pods)
    return Observed(
        unit_observations(spec, pods, admissions),
        view.ready if view.ready is not None else pods_sync_ready,
        view.status,
        chaos_status.kills,
        {k: float(v) for k, v in chaos_status.down_until.items() if v is not None},
        job=job,
        sync_problem=view.problem,
        sync_unschedulable=sync_unschedulable,
        sync_unreachable=view.unreachable,
        restarting=restarting,
        sync_conflict=sync_storage_conflict(pods),
        sync_image=sync_image_problem(pods),
    )


def compute(
    ctx: Context, state: JobState, spec: DiLoCoJobSpec, now: datetime
) -> tuple[JobStatus, list[Event]]:
    """The job's status from the pods the watch saw and the synchronizer's last answer (pure but for
    the reads of the cache); its events are the differences from the last status."""
    job, old = state.ref, state.current_status()
    chaos_status = state.chaos or old.chaos or ChaosStatus()
    pods = ctx.pods.pods(job.namespace, job.name)
    obs = observation(
        spec, job.name, pods, state.sync, chaos_status, frozenset(state.restarts), state.admissions
    )
    new = compute_status(spec, obs, old, now, state.body["metadata"].get("generation"))
    gate = chaos.chaos_gate(spec.chaos, ctx.settings.allow_chaos)
    conditions = new.conditions
    if gate is not None:
        conditions += (condition(old.conditions, "Chaos", gate.active, gate.reason, gate.message, now),)
    conditions += (
        rollout_condition(
            old.conditions,
            state.rollout,
            restarting_into(state.restarts, state.templates),
            obs.units,
            spec.diloco.quorum,
            now,
        ),
    )
    exported = job_export(spec, new, pods)
    new = new.model_copy(update={"chaos": chaos_status, "conditions": conditions, "export": exported})
    events = diff_events(old, new) + export_events(old.export, exported)
    if gate is not None:
        events += chaos.gate_events(old, gate)
    return new, events


def restart_outdated(ctx: Context, state: JobState, spec: DiLoCoJobSpec, now: datetime) -> list[Event]:
    """Delete, all at once, the pods of each unit the rollout restarts now (``state.rollout``) that are
    made from an older pod template: a unit is one torch.distributed group, which must restart
    together (its StatefulSet is ``OnDelete``). Each unit restarted is remembered from ``now``: its
    pods down are the operator's doing, no loss."""
    job = state.ref
    events = []
    replicas = {u.name: u.replicas for u in spec.learner_units}
    outdated = outdated_pods(ctx.pods.pods(job.namespace, job.name), state.templates)
    for unit in state.rollout.restart:
        pods = outdated.get(unit, [])
        deleted = [p.name for p in pods if ctx.kube.delete("v1", "Pod", job.namespace, p.name, uid=p.uid)]
        if deleted:
            state.restarts[unit] = Restart(now.timestamp(), state.templates[unit])
            log.info(
                "job %s/%s: unit %s restarts together for its new pod template: %s",
                job.namespace,
                job.name,
                unit,
                ", ".join(deleted),
            )
            events.append(
                Event(
                    "Normal",
                    "UnitRestart",
                    (
                        f"unit {unit}: the pod template changed, so its pods restart together ({', '.join(deleted)}): "
                        f"the {replicas.get(unit, 0)} pod(s) of a unit form one torch.distributed group, whose size "
                        "is in every pod's environment, and start and stop as one"
                    ),
                )
            )
    return events


def reconcile_pass(ctx: Context, state: JobState, req: Request) -> None:
    """Bring the children to the spec (blocking; run in a thread). A spec that can never work is
    remembered for the refresh that follows, which says so in the status."""
    if state.body["metadata"].get("deletionTimestamp"):
        return  # the garbage collector is removing the children: do not recreate them
    # on the freshest spec, and not for a job deleted meanwhile
    fresh = ctx.kube.get(API_VERSION, KIND, state.ref.namespace, state.ref.name)
    if (
        fresh is None
        or fresh["metadata"].get("uid") != state.ref.uid
        or fresh["metadata"].get("deletionTimestamp")
    ):
        return
    state.body = fresh
    generation = fresh["metadata"].get("generation")
    now = datetime.now(UTC)
    try:
        spec = check_spec(ctx.kube, state.ref, fresh.get("spec") or {}, fresh["metadata"])
        events = reconcile(ctx, state, spec, req, now)
        state.admissions = read_admissions(ctx.kube, state.ref, spec)
    except SpecError as exc:
        state.invalid = (generation, str(exc))
        state.reconciled_generation = generation
        ctx.metrics.reconciles.labels(req.trigger, "invalid").inc()
        return
    state.invalid = None
    if req.fetch:
        pods_ready, _ = sync_observation(spec, ctx.pods.pods(state.ref.namespace, state.ref.name))
        ca_pem = read_ca_bundle(ctx.kube, state.ref.namespace, spec.synchronizer.ca)
        state.sync = read_synchronizer(ctx.fetch, ctx.settings.sync_url, state.ref, spec, pods_ready, ca_pem)
    post_events(ctx.kube, state.body, events, ctx.instance)
    ctx.metrics.reconciles.labels(req.trigger, "ok").inc()


def refresh_pass(ctx: Context, state: JobState) -> Request | None:
    """Compute and write the status (blocking; run in a thread); restart the units whose pods are
    outdated. Returns the reconcile the new status calls for, if any."""
    meta = state.body["metadata"]
    if meta.get("deletionTimestamp"):
        return None
    generation = meta.get("generation")
    problem = state.invalid[1] if state.invalid is not None and state.invalid[0] == generation else None
    try:
        if problem is not None:
            raise SpecError(problem)
        spec = with_job_queue(parse_spec(dict(state.body.get("spec") or {})), meta)  # as check_spec reads it
        validate_job(state.ref.name, spec)
    except SpecError as exc:
        invalid(ctx, state, str(exc), generation)
        return None
    now = datetime.now(UTC)
    pods = ctx.pods.pods(state.ref.namespace, state.ref.name)
    state.restarts = restarts_under_way(spec, pods, state.restarts, now.timestamp())
    state.rollout = plan_rollout(
        outdated_pods(pods, state.templates),
        unit_observations(spec, pods),
        restarting_into(state.restarts, state.templates),
        failing_units(pods, state.templates),
        spec.diloco.quorum,
    )
    new, events = compute(ctx, state, spec, now)
    write_status(ctx, state, new, events)
    post_events(ctx.kube, state.body, restart_outdated(ctx, state, spec, now), ctx.instance)
    ctx.metrics.reconciles.labels("status", "ok").inc()
    if state.current_status().phase == "Succeeded" and not state.learners_stopped:
        return Request(reconcile=True, trigger="succeeded")  # scale the learners down now
    return None
