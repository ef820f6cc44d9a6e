"""kopf handlers: thin glue between the watches and the per-job workers (``jobs``, ``passes``).

- The DiLoCoJob watch: a new job, or a new spec generation, asks for a reconcile; every event also
  feeds liveness, and a deleted job's worker and memory go.
- The pod watch (pods this operator manages): every event updates ``pods.PodCache`` and asks for a
  status refresh of its job (debounced), and reports learner units losing and regaining a pod.
- The StatefulSet and Deployment watches: a child deleted behind the operator's back is put back
  at once.
- A resync loop (every ``--resync-seconds``) reconciles every job: it repairs drift of the children
  no watch covers, reads the synchronizers' status and drives built-in chaos.

No handler needs a finalizer on the jobs (no kopf timer, daemon or delete handler): ``kubectl
delete dilocojob`` never waits for the operator, and the garbage collector removes the children
through their owner references. One left by an earlier version of the operator is removed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes import client, config

from diloco_operator.builders.names import (
    COMPONENT_LABEL,
    GROUP,
    JOB_LABEL,
    MANAGED_BY,
    PLURAL,
    UNIT_LABEL,
    VERSION,
)
from diloco_operator.glue.peering import ensure_peering
from diloco_operator.kube import Kube, api_error
from diloco_operator.runtime.jobs import JobRegistry, JobState, Request
from diloco_operator.runtime.liveness import WatchState, paused_by_peers, watch_is_alive
from diloco_operator.runtime.metrics import OperatorMetrics
from diloco_operator.runtime.passes import Context, post_events, reconcile_pass, refresh_pass
from diloco_operator.runtime.pods import PodCache, PodWatch
from diloco_operator.runtime.syncstatus import http_fetcher
from diloco_operator.settings import OperatorSettings, settings_from_env
from diloco_operator.status.pods import observe_pod

log = logging.getLogger(__name__)

BACKOFF_SECONDS = 5.0  # retry delay of a pass that failed on an API error
DEBOUNCE_SECONDS = 0.25  # a burst of pod events makes one status refresh
PASS_THREADS = 8  # passes (of different jobs, or a job's reconcile and refresh) that run at once
LEGACY_FINALIZER = f"{GROUP}/operator"  # set by earlier versions of the operator (kopf's timer needed it)
MANAGED = {"app.kubernetes.io/managed-by": MANAGED_BY}
INSTANCE = socket.gethostname()  # in a pod: the pod name


def new_api_client(pool_size: int) -> client.ApiClient:
    """In a pod: its service account; elsewhere: $KUBECONFIG (read now, not at import). Its pool
    keeps a connection per concurrent request."""
    cfg = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), client_configuration=cfg)
    cfg.connection_pool_maxsize = pool_size
    return client.ApiClient(cfg)


def operator_settings(memo: kopf.Memo) -> OperatorSettings:
    """The settings ``diloco operator`` put in the memo; started by ``kopf run`` instead (as the tests'
    ``KopfRunner`` does), the ``DILOCO_OPERATOR_*`` variables, read once here."""
    settings = memo.get("settings")
    return settings if isinstance(settings, OperatorSettings) else settings_from_env()


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In-cluster service account, else $KUBECONFIG as it is set when the operator starts."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    ours = operator_settings(memo)
    namespaces = list(memo.get("namespaces") or [])
    # Our own events only: kopf would post every error it logs, traceback included, on the job.
    settings.posting.enabled = False
    # Named namespaces: nothing cluster-wide to discover. kopf would otherwise list the namespaces
    # (a cluster-wide right that a namespaced install does not grant: refused, retried for a minute)
    # and watch the CRDs.
    settings.scanning.disabled = bool(namespaces)
    metrics = OperatorMetrics()
    if ours.metrics_port:
        metrics.serve(ours.metrics_port)
    kube = Kube(new_api_client(ours.apply_concurrency + PASS_THREADS))
    ctx = Context(
        ours,
        kube,
        http_fetcher(ours.status_timeout_seconds),
        metrics,
        random.Random(ours.chaos_seed),
        PodCache(),
        PodWatch(),
        WatchState(),
        namespaces,
        ThreadPoolExecutor(ours.apply_concurrency, thread_name_prefix="apply"),
        INSTANCE,
    )
    passes = ThreadPoolExecutor(PASS_THREADS, thread_name_prefix="pass")

    async def reconcile(state: JobState, req: Request) -> None:
        await asyncio.get_running_loop().run_in_executor(passes, reconcile_pass, ctx, state, req)

    async def refresh(state: JobState) -> Request | None:
        return await asyncio.get_running_loop().run_in_executor(passes, refresh_pass, ctx, state)

    if namespaces and await asyncio.to_thread(kube.get_cluster, f"/apis/{GROUP}/{VERSION}") is None:
        # kopf discovers the resources once when it does not scan: it would wait for them in silence
        raise kopf.PermanentError(
            f"the DiLoCoJob CRD ({PLURAL}.{GROUP}/{VERSION}) is not served: install it "
            "(kubectl apply -f crds/) and start the operator again"
        )
    memo.ctx = ctx
    memo.jobs = JobRegistry(reconcile, refresh, debounce=DEBOUNCE_SECONDS, backoff=BACKOFF_SECONDS)
    memo.passes = passes
    if not settings.peering.standalone:
        await asyncio.to_thread(
            ensure_peering, kube, settings.peering.name, namespaces, settings.peering.priority
        )
    memo.resync = asyncio.create_task(resync_loop(ctx, memo.jobs, settings, str(memo.get("identity", ""))))
    log.info(
        "operator started: %s, resync every %gs, metrics port %s, chaos %s",
        f"namespaces {', '.join(namespaces)}" if namespaces else "all namespaces",
        ours.resync_seconds,
        ours.metrics_port,
        "allowed" if ours.allow_chaos else "not allowed",
    )


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    memo.resync.cancel()
    await memo.jobs.stop_all()
    memo.passes.shutdown(wait=False, cancel_futures=True)
    memo.ctx.pool.shutdown(wait=False, cancel_futures=True)


async def resync_loop(ctx: Context, jobs: JobRegistry, settings: kopf.OperatorSettings, own_id: str) -> None:
    """Reconcile every job every ``resync_seconds``, unless a peer keeps this operator paused."""
    while True:
        await asyncio.sleep(ctx.settings.resync_seconds)
        if not settings.peering.standalone:
            try:
                peering = await asyncio.to_thread(
                    ctx.kube.get_cluster, peering_path(settings, ctx.namespaces)
                )
            except Exception as exc:  # (the API is away: try again next round)
                log.warning("resync skipped: cannot read the peering object: %s", api_error(exc))
                continue
            if paused_by_peers(peering, settings.peering.priority, datetime.now(UTC), own_id):
                continue
        for worker in list(jobs.workers.values()):
            worker.request(Request(reconcile=True, chaos=True, fetch=True, trigger="timer"))


@kopf.on.event(GROUP, VERSION, PLURAL)
async def on_job_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """Every event of the job watch (listing included): liveness, and a reconcile per new generation."""
    body: dict[str, Any] = dict(event["object"])
    meta: dict[str, Any] = body.get("metadata") or {}
    deleted = event["type"] == "DELETED"
    memo.ctx.watch.heard(str(meta.get("uid")), str(meta.get("resourceVersion")), deleted=deleted)
    jobs: JobRegistry = memo.jobs
    if deleted:
        await jobs.forget(str(meta.get("uid")))
        memo.ctx.metrics.forget(meta["namespace"], meta["name"])
        memo.ctx.pods.forget(meta["namespace"], meta["name"])
        return
    if LEGACY_FINALIZER in (meta.get("finalizers") or []):
        await asyncio.to_thread(drop_legacy_finalizer, memo.ctx.kube, body)
    first = jobs.find(meta["namespace"], meta["name"]) is None
    worker = jobs.seen(body)
    generation = meta.get("generation")
    if meta.get("deletionTimestamp") or worker.state.requested_generation == generation:
        return
    worker.state.requested_generation = generation
    trigger = "update" if not first else "create" if event["type"] == "ADDED" else "resume"
    worker.request(Request(reconcile=True, fetch=True, trigger=trigger))


def drop_legacy_finalizer(kube: Kube, body: dict[str, Any]) -> None:
    finalizers = list(body["metadata"].get("finalizers") or [])
    kept = [f for f in finalizers if f != LEGACY_FINALIZER]
    if kube.patch_json(
        body,
        [
            {"op": "test", "path": "/metadata/finalizers", "value": finalizers},
            {"op": "replace", "path": "/metadata/finalizers", "value": kept},
        ],
    ):
        log.info(
            "job %s/%s: removed the finalizer %s (the operator no longer needs one)",
            body["metadata"]["namespace"],
            body["metadata"]["name"],
            LEGACY_FINALIZER,
        )


@kopf.on.event("", "v1", "pods", labels=MANAGED)
async def on_pod_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """A pod of a job changed: refresh the job's status, and report a learner unit losing a pod or
    getting it back as it happens."""
    obj: dict[str, Any] = dict(event["object"])
    deleted = event["type"] == "DELETED"
    ctx: Context = memo.ctx
    key = ctx.pods.update(obj, deleted=deleted)
    worker = memo.jobs.find(*key) if key else None
    if worker is None:
        return
    worker.request(Request(trigger="watch"))
    meta: dict[str, Any] = obj.get("metadata") or {}
    labels: dict[str, str] = meta.get("labels") or {}
    if labels.get(COMPONENT_LABEL) != "learner":
        return
    pod = observe_pod(obj)
    ev = ctx.losses.observe(
        f"{meta.get('namespace')}/{meta.get('name')}",
        labels.get(UNIT_LABEL, ""),
        phase=pod.phase,
        ready=pod.ready,
        deleted=deleted or pod.deleting,
        gone=deleted,
    )
    if ev is not None:
        await asyncio.to_thread(post_events, ctx.kube, worker.state.body, [ev], ctx.instance)


@kopf.on.event("apps", "v1", "statefulsets", labels=MANAGED)
@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
async def on_child_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """A StatefulSet or Deployment of a job deleted behind the operator's back is put back at once."""
    if event["type"] != "DELETED":
        return
    obj: dict[str, Any] = dict(event["object"])
    meta: dict[str, Any] = obj.get("metadata") or {}
    job = (meta.get("labels") or {}).get(JOB_LABEL)
    worker = memo.jobs.find(meta.get("namespace"), job) if job else None
    if worker is not None:
        worker.request(Request(reconcile=True, trigger="drift"))


@kopf.on.probe(id="api")
def probe(memo: kopf.Memo, settings: kopf.OperatorSettings, **_: Any) -> str:
    """Liveness: a live API round trip, and the job watch delivering what the API holds.

    A failure raises ``kopf.PermanentError`` so the endpoint answers 500 at once (kopf retries
    other errors of an activity handler before it answers).
    """
    ctx: Context = memo.ctx
    try:
        listed = ctx.kube.job_versions(ctx.namespaces)
        peering = (
            None
            if settings.peering.standalone
            else ctx.kube.get_cluster(peering_path(settings, ctx.namespaces))
        )
    except Exception as exc:
        raise kopf.PermanentError(f"API unreachable: {api_error(exc)}") from exc
    own_id = str(memo.get("identity", ""))
    if not settings.peering.standalone and paused_by_peers(
        peering, settings.peering.priority, datetime.now(UTC), own_id
    ):
        ctx.watch.pause()
        return "paused"
    now = time.monotonic()
    due = ctx.watch.compare(listed, now)
    if not watch_is_alive(due, now, ctx.settings.watch_stale_seconds):
        raise kopf.PermanentError(
            f"the DiLoCoJob watch has not delivered {len(due)} job change(s) for over "
            f"{ctx.settings.watch_stale_seconds:g}s"
        )
    return "ok"


def peering_path(settings: kopf.OperatorSettings, namespaces: list[str]) -> str:
    """The peering object: cluster-wide, or (``--namespace``) the one in the first watched namespace."""
    name = settings.peering.name
    if settings.peering.clusterwide or not namespaces:
        return f"/apis/kopf.dev/v1/clusterkopfpeerings/{name}"
    return f"/apis/kopf.dev/v1/namespaces/{namespaces[0]}/kopfpeerings/{name}"
