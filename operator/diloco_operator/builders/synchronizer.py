"""Pure builders of the synchronizer's Deployment and Service (one pair per shard)."""

from __future__ import annotations

from typing import Any

from diloco_operator.builders import env
from diloco_operator.builders.containers import (
    SYNC_DEFAULT_REQUESTS,
    container_security_context,
    http_probe,
    pod_security_context,
    with_default_requests,
)
from diloco_operator.builders.names import (
    CONFIG_HASH_ANNOTATION,
    JOB_LABEL,
    SHARD_LABEL,
    JobRef,
    labels,
    metadata,
    secret_name,
    sync_name,
    sync_port_name,
    sync_url,
)
from diloco_operator.builders.pod_settings import with_pod_settings
from diloco_operator.builders.volumes import (
    config_mounts,
    config_volumes,
    revocations_mounts,
    revocations_volumes,
    tls_mounts,
    tls_volumes,
)
from diloco_operator.schema.spec import DiLoCoJobSpec, sync_pod_settings

COMPONENT = "synchronizer"


def selector(job: str, shard: int) -> dict[str, str]:
    return {JOB_LABEL: job, "app.kubernetes.io/component": COMPONENT, SHARD_LABEL: str(shard)}


def sync_env(job: JobRef, spec: DiLoCoJobSpec, shard: int) -> list[dict[str, Any]]:
    shards = spec.synchronizer.shards
    urls = ",".join(sync_url(job, spec, i) for i in range(shards))
    return [
        env.value("DILOCO_JOB_ID", job.name),
        env.value("DILOCO_JOB_OWNER", f"{job.namespace}/{job.name}"),
        env.job_secret_env(spec, secret_name(job.name)),
        *env.config_env(),
        env.value("DILOCO_STORAGE", spec.storage.url),
        env.value("DILOCO_HOST", "0.0.0.0"),
        env.value("DILOCO_PORT", env.SYNC_PORT),
        env.value("DILOCO_SHARD_INDEX", shard),
        env.value("DILOCO_NUM_SHARDS", shards),
        env.value("DILOCO_SHARD_URLS", urls),
        *env.sync_tls_env(spec),
        env.revocations_env(),
        env.value("DILOCO_MIN_STEP_TIME_S", repr(spec.synchronizer.min_step_time_seconds)),
        *env.memory_env(spec.synchronizer.memory_budgets),
        *env.storage_env(spec),
    ]


def build_sync_deployment(job: JobRef, spec: DiLoCoJobSpec, shard: int, digest: str) -> dict[str, Any]:
    """One synchronizer shard. ``Recreate``: a shard must never have two writers to storage."""
    replicas = 0 if spec.suspend else 1
    pod_labels = labels(job.name, COMPONENT, **{SHARD_LABEL: str(shard)})
    port = sync_port_name(spec)
    scheme = port.upper()  # the kubelet's probes speak TLS to a TLS port (without checking its certificate)
    container = {
        "name": "synchronizer",
        "image": spec.images.synchronizer,
        "imagePullPolicy": spec.images.pull_policy,
        "command": ["diloco", "synchronizer"],
        "ports": [{"name": port, "containerPort": env.SYNC_PORT}],
        "env": [*sync_env(job, spec, shard), *spec.synchronizer.env],
        "resources": with_default_requests(spec.synchronizer.resources, SYNC_DEFAULT_REQUESTS),
        "livenessProbe": http_probe("/healthz", port, 10, 6, scheme),
        "readinessProbe": http_probe("/readyz", port, 5, 3, scheme),
        "securityContext": container_security_context(),
        "volumeMounts": config_mounts() + tls_mounts(spec) + revocations_mounts(),
        # why it exited (its log's last line: a storage prefix of another job, say) shows in the
        # pod's termination message, which the job's status reads (``status.pods``)
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    template = {
        "metadata": {"labels": pod_labels, "annotations": {CONFIG_HASH_ANNOTATION: digest}},
        "spec": {
            "automountServiceAccountToken": False,
            "securityContext": pod_security_context(),
            "terminationGracePeriodSeconds": 30,
            "containers": [container],
            "volumes": config_volumes(job.name) + tls_volumes(spec) + revocations_volumes(job.name),
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(job, sync_name(job.name, shard), COMPONENT, **{SHARD_LABEL: str(shard)}),
        "spec": {
            "replicas": replicas,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector(job.name, shard)},
            "template": with_pod_settings(template, sync_pod_settings(spec)),
        },
    }


def build_sync_service(job: JobRef, shard: int, port: str = "http") -> dict[str, Any]:
    """``port``: the port's name, ``https`` when the synchronizer serves TLS (``sync_port_name``)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(job, sync_name(job.name, shard), COMPONENT, **{SHARD_LABEL: str(shard)}),
        "spec": {
            "type": "ClusterIP",
            # Learners must reach the synchronizer while /readyz says 503 (a storage outage): it
            # keeps accepting contributions in memory then, by design. Readiness stays /readyz, so
            # the Deployment and the job's SynchronizerReady condition still tell the truth; the
            # Service just does not drop the pod for it. (Recreate: never two pods to choose from.)
            "publishNotReadyAddresses": True,
            "selector": selector(job.name, shard),
            "ports": [{"name": port, "port": env.SYNC_PORT, "targetPort": port, "protocol": "TCP"}],
        },
    }
