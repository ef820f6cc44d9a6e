"""kopf handlers: thin glue around ``reconcile``.

One level-based reconcile serves create, update and resume; a timer runs the same reconcile
every ``DILOCO_OPERATOR_RESYNC_SECONDS`` to repair drift, refresh the status and drive chaos.
Liveness checks that the DiLoCoJob watch still delivers what the API holds (see ``liveness``).
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes import client, config

from diloco_operator.build import API_VERSION, GROUP, JOB_LABEL, KIND, PLURAL, UNIT_LABEL, VERSION, JobRef
from diloco_operator.job_status import JobStatus
from diloco_operator.kube import Kube, api_error
from diloco_operator.liveness import WatchState, paused_by_peers, watch_is_alive
from diloco_operator.metrics import OperatorMetrics
from diloco_operator.reconcile import Outcome, StatusFetcher, reconcile
from diloco_operator.settings import OperatorSettings, settings_from_env
from diloco_operator.status import Event, PodWatch, event_object, unit_state_counts
from diloco_operator.syncstatus import http_fetcher

log = logging.getLogger(__name__)

# kopf needs the timer interval when the module is imported.
RESYNC_SECONDS = settings_from_env().resync_seconds
# Retry delay of a reconcile that failed on an API error (kopf's default is a minute).
BACKOFF_SECONDS = 5.0
INSTANCE = socket.gethostname()  # in a pod: the pod name


@dataclass
class Context:
    """Everything the handlers share, built once at start-up and kept in kopf's memo."""

    settings: OperatorSettings
    kube: Kube
    fetch: StatusFetcher
    metrics: OperatorMetrics
    rng: random.Random
    pods: PodWatch
    watch: WatchState
    namespaces: list[str]  # the namespaces kopf watches; empty: all


def new_api_client() -> client.ApiClient:
    """In a pod: its service account; elsewhere: $KUBECONFIG (read now, not at import)."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        cfg = client.Configuration()
        config.load_incluster_config(client_configuration=cfg)
        return client.ApiClient(cfg)
    return config.new_client_from_config(config_file=os.environ.get("KUBECONFIG"))


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account, else $KUBECONFIG as it is set when the operator starts."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    ours = settings_from_env()
    settings.persistence.finalizer = f"{GROUP}/operator"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING  # our own events, not every log line
    metrics = OperatorMetrics()
    if ours.metrics_port:
        metrics.serve(ours.metrics_port)
    memo.ctx = Context(ours, Kube(new_api_client()), http_fetcher(ours.status_timeout_seconds), metrics,
                       random.Random(ours.chaos_seed), PodWatch(), WatchState(),
                       list(memo.get("namespaces") or []))
    log.info("operator started: resync every %ss, metrics port %s, chaos %s", ours.resync_seconds,
             ours.metrics_port, "allowed" if ours.allow_chaos else "not allowed")


@kopf.on.event(GROUP, VERSION, PLURAL)
async def on_job_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """Every event of the job watch (listing included): what liveness compares the API with."""
    meta = event["object"].get("metadata") or {}
    memo.ctx.watch.heard(str(meta.get("uid")), str(meta.get("resourceVersion")), deleted=event["type"] == "DELETED")


@kopf.on.probe(id="api")
def probe(memo: kopf.Memo, settings: kopf.OperatorSettings, **_: Any) -> str:
    """Liveness: a live API round trip, and the job watch delivering what the API holds.

    A failure raises ``kopf.PermanentError`` so the endpoint answers 500 at once (kopf retries
    other errors of an activity handler before it answers).
    """
    ctx: Context = memo.ctx
    try:
        listed = ctx.kube.job_versions(ctx.namespaces)
        peering = None if settings.peering.standalone else ctx.kube.get_cluster(peering_path(settings, ctx.namespaces))
    except Exception as exc:
        raise kopf.PermanentError(f"API unreachable: {api_error(exc)}") from exc
    own_id = str(memo.get("identity", ""))
    if not settings.peering.standalone and paused_by_peers(peering, settings.peering.priority, datetime.now(UTC), own_id):
        ctx.watch.pause()
        return "paused"
    now = time.monotonic()
    due = ctx.watch.compare(listed, now)
    if not watch_is_alive(due, now, ctx.settings.watch_stale_seconds):
        raise kopf.PermanentError(
            f"the DiLoCoJob watch has not delivered {len(due)} job change(s) for over "
            f"{ctx.settings.watch_stale_seconds:g}s")
    return "ok"


def peering_path(settings: kopf.OperatorSettings, namespaces: list[str]) -> str:
    """The peering object: cluster-wide, or (``--namespace``) the one in the first watched namespace."""
    name = settings.peering.name
    if settings.peering.clusterwide or not namespaces:
        return f"/apis/kopf.dev/v1/clusterkopfpeerings/{name}"
    return f"/apis/kopf.dev/v1/namespaces/{namespaces[0]}/kopfpeerings/{name}"


def post_events(kube: Kube, job: Mapping[str, Any], events: list[Event]) -> None:
    """Post each event about ``job`` now, from this handler (an event that cannot be posted is logged).

    Posted synchronously rather than through kopf's background poster, so an event is in the API
    before the status change that goes with it, and a failure is never silent.
    """
    now = datetime.now(UTC)
    for ev in events:
        try:
            kube.create(event_object(job, ev, now, INSTANCE))
        except Exception as exc:  # events are auxiliary: never fail the reconcile for one
            log.warning("could not post event %s %s on %s: %s", ev.type, ev.reason,
                        job["metadata"].get("name"), api_error(exc))


def run(ctx: Context, trigger: str, body: kopf.Body, patch: kopf.Patch, *, chaos: bool) -> Outcome:
    meta = body["metadata"]
    job = JobRef(meta["name"], meta["namespace"], meta["uid"])
    outcome = reconcile(
        ctx.kube, job, body.get("spec") or {}, JobStatus.read(body.get("status") or {}),
        now=datetime.now(UTC), fetch=ctx.fetch, generation=meta.get("generation"),
        sync_url_override=ctx.settings.sync_url, rng=ctx.rng if chaos else None,
        allow_chaos=ctx.settings.allow_chaos,
    )
    patch.status.update(outcome.status.to_patch())
    post_events(ctx.kube, body, outcome.events)
    ctx.metrics.chaos_kills.inc(sum(ev.reason == "ChaosKill" for ev in outcome.events))
    for action, n in (("created", outcome.created), ("restored", outcome.repaired), ("deleted", outcome.deleted)):
        if n:
            ctx.metrics.children.labels(action).inc(n)
    ctx.metrics.set_phase(job.namespace, job.name, str(outcome.status.phase))
    ctx.metrics.set_units(job.namespace, job.name, unit_state_counts(outcome.status))
    ctx.metrics.reconciles.labels(trigger, "invalid" if outcome.invalid else "ok").inc()
    return outcome


@kopf.on.resume(GROUP, VERSION, PLURAL, backoff=BACKOFF_SECONDS)
@kopf.on.create(GROUP, VERSION, PLURAL, backoff=BACKOFF_SECONDS)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec", backoff=BACKOFF_SECONDS)
def on_change(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, reason: str, **_: Any) -> None:
    outcome = run(memo.ctx, str(reason), body, patch, chaos=False)
    if outcome.invalid:
        # The status and the event say what to change; retrying cannot help until the spec changes.
        raise kopf.PermanentError(outcome.invalid)


@kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS,
            backoff=BACKOFF_SECONDS)
def resync(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    if body["metadata"].get("deletionTimestamp"):
        return  # the garbage collector is removing the children; do not recreate them
    run(memo.ctx, "timer", body, patch, chaos=True)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def on_delete(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Children go with the garbage collector (owner references); only our metrics need forgetting."""
    memo.ctx.metrics.forget(body["metadata"]["namespace"], body["metadata"]["name"])


@kopf.on.event("", "v1", "pods",
               labels={"app.kubernetes.io/managed-by": "diloco-operator", "app.kubernetes.io/component": "learner"})
def on_learner_pod_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """Report a learner unit losing a pod and getting it back, as it happens."""
    obj: dict[str, Any] = dict(event["object"])
    meta: dict[str, Any] = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    status = obj.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    deleted = event["type"] == "DELETED" or bool(meta.get("deletionTimestamp"))
    ev = memo.ctx.pods.observe(f"{meta.get('namespace')}/{meta.get('name')}", labels.get(UNIT_LABEL, ""),
                               phase=str(status.get("phase")), ready=ready, deleted=deleted)
    job_name = labels.get(JOB_LABEL)
    if ev is None or not job_name:
        return
    job = memo.ctx.kube.get(API_VERSION, KIND, meta["namespace"], job_name)
    if job is not None:
        post_events(memo.ctx.kube, job, [ev])
