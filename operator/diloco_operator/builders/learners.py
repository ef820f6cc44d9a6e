"""Pure builders of a learner unit: StatefulSet, headless Service and PodDisruptionBudget."""

from __future__ import annotations

from typing import Any

from diloco_operator.builders import env
from diloco_operator.builders.config import template_hash
from diloco_operator.builders.containers import (
    container_security_context,
    http_probe,
    pod_security_context,
    unit_resources,
)
from diloco_operator.builders.names import (
    CONFIG_HASH_ANNOTATION,
    JOB_LABEL,
    PREFERRED_TOPOLOGY_ANNOTATION,
    PRIORITY_LABEL,
    QUEUE_LABEL,
    REQUIRED_TOPOLOGY_ANNOTATION,
    TEMPLATE_HASH_ANNOTATION,
    UNIT_LABEL,
    JobRef,
    job_id,
    labels,
    metadata,
    sync_url,
    unit_name,
)
from diloco_operator.builders.pod_settings import with_pod_settings
from diloco_operator.builders.volumes import (
    config_mounts,
    config_volumes,
    sync_ca_mounts,
    sync_ca_volumes,
    token_mounts,
    token_volumes,
)
from diloco_operator.schema.spec import DiLoCoJobSpec, LearnerUnit, UnitTopology, unit_pod_settings

COMPONENT = "learner"
REGION_LABEL = "topology.kubernetes.io/region"
# SIGTERM: finish the step, send what is due, checkpoint and leave the quorum.
TERMINATION_GRACE_SECONDS = 120


def selector(job: str, unit: str) -> dict[str, str]:
    return {JOB_LABEL: job, "app.kubernetes.io/component": COMPONENT, UNIT_LABEL: unit}


def learner_env(job: JobRef, spec: DiLoCoJobSpec, unit: LearnerUnit) -> list[dict[str, Any]]:
    name = unit_name(job.name, unit.name)
    out = [
        env.value("DILOCO_JOB_ID", job_id(job, spec)),
        env.value("DILOCO_UNIT", unit.name),
        env.field_ref("DILOCO_LEARNER_ID", "metadata.name"),
        env.field_ref("DILOCO_NAMESPACE", "metadata.namespace"),
        env.value("DILOCO_SYNC_URL", sync_url(job, spec)),
        *env.sync_ca_env(spec),
        env.learner_token_env(),
        *env.config_env(),
        # Durable: a replaced pod (same name, so same learner id) resumes from it. Kubernetes
        # expands $(DILOCO_LEARNER_ID), defined above, to the pod's name.
        env.value("DILOCO_CHECKPOINT_DIR", f"{spec.storage.url}/checkpoints/$(DILOCO_LEARNER_ID)"),
        env.value("DILOCO_BATCH_SIZE", unit.batch_size),
        env.units_env(),
        env.value("WORLD_SIZE", unit.replicas),
        env.value("MASTER_ADDR", f"{name}-0.{name}.{job.namespace}.svc"),
        env.value("MASTER_PORT", env.DIST_PORT),
        env.value("DILOCO_HEALTH_HOST", "0.0.0.0"),
        env.value("DILOCO_HEALTH_PORT", env.HEALTH_PORT),
        # A finished learner stays up (ready, idle) instead of exiting: the StatefulSet would restart
        # it. The operator scales the unit down once the whole job has Succeeded.
        env.value("DILOCO_WHEN_DONE", "wait"),
        *env.storage_env(spec),
    ]
    if unit.region:
        out.append(env.value("DILOCO_REGION", unit.region))
    if spec.train.compile:
        out.append(env.value("DILOCO_COMPILE", "true"))
    return out


def pod_placement(unit: LearnerUnit) -> dict[str, Any]:
    """nodeSelector (with the unit's region), affinity and tolerations of the unit's pods."""
    node_selector = dict(unit.node_selector)
    if unit.region:
        node_selector[REGION_LABEL] = unit.region
    placement: dict[str, Any] = {}
    if node_selector:
        placement["nodeSelector"] = node_selector
    if unit.affinity:
        placement["affinity"] = unit.affinity
    if unit.tolerations:
        placement["tolerations"] = unit.tolerations
    return placement


def build_pod_template(job: JobRef, spec: DiLoCoJobSpec, unit: LearnerUnit, digest: str) -> dict[str, Any]:
    container = {
        "name": "learner",
        "image": spec.images.worker,
        "imagePullPolicy": spec.images.pull_policy,
        "command": ["diloco", "worker"],
        "ports": [
            {"name": "health", "containerPort": env.HEALTH_PORT},
            {"name": "dist", "containerPort": env.DIST_PORT},
        ],
        # the spec's own additions (pod_additions) after the operator's: a value may refer to those
        "env": [*learner_env(job, spec, unit), *spec.learners.env, *unit.env],
        "resources": unit_resources(unit),
        "livenessProbe": http_probe("/healthz", "health", 15, 8),
        "readinessProbe": http_probe("/readyz", "health", 10, 3),
        "securityContext": container_security_context(),
        "volumeMounts": [
            *config_mounts(),
            *sync_ca_mounts(spec),
            *token_mounts(),
            *spec.learners.volume_mounts,
            *unit.volume_mounts,
        ],
    }
    template = {
        "metadata": {
            "labels": labels(job.name, COMPONENT, **{UNIT_LABEL: unit.name}),
            "annotations": {CONFIG_HASH_ANNOTATION: digest},
        },
        "spec": {
            "automountServiceAccountToken": False,
            "securityContext": pod_security_context(),
            "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
            "containers": [container],
            "volumes": [
                *config_volumes(job.name),
                *sync_ca_volumes(spec),
                *token_volumes(job.name, unit.name),
                *spec.learners.volumes,
                *unit.volumes,
            ],
            **pod_placement(unit),
        },
    }
    if unit.topology is not None:
        template["metadata"]["annotations"].update(topology_annotations(unit.topology))
    return with_pod_settings(template, unit_pod_settings(spec, unit))


def topology_annotations(topology: UnitTopology) -> dict[str, str]:
    """Kueue's annotation asking for the unit's pods in one domain of a topology level."""
    if topology.required is not None:
        return {REQUIRED_TOPOLOGY_ANNOTATION: topology.required}
    assert topology.preferred is not None
    return {PREFERRED_TOPOLOGY_ANNOTATION: topology.preferred}


def queue_labels(spec: DiLoCoJobSpec) -> dict[str, str]:
    """Kueue's labels of a unit's StatefulSet: each unit is a workload of its own in the job's queue."""
    out = {QUEUE_LABEL: spec.queue_name} if spec.queue_name else {}
    if spec.queue_name and spec.workload_priority_class_name:
        out[PRIORITY_LABEL] = spec.workload_priority_class_name
    return out


def build_statefulset(
    job: JobRef, spec: DiLoCoJobSpec, unit: LearnerUnit, digest: str, *, stopped: bool
) -> dict[str, Any]:
    """The unit's StatefulSet. ``OnDelete``: the pods of a unit are one torch.distributed group (its
    size is in their environment), so a new pod template must restart them together, not one by
    one as a rolling update would; the operator deletes the outdated pods at once (``pods.outdated_pods``)."""
    name = unit_name(job.name, unit.name)
    template = build_pod_template(job, spec, unit, digest)
    template["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION] = template_hash(template)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(job, name, COMPONENT, **{UNIT_LABEL: unit.name}, **queue_labels(spec)),
        "spec": {
            "replicas": 0 if stopped else unit.replicas,
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "selector": {"matchLabels": selector(job.name, unit.name)},
            "template": template,
        },
    }


def build_headless_service(job: JobRef, unit: LearnerUnit) -> dict[str, Any]:
    """Stable DNS names for the unit's pods (the torch.distributed rendezvous)."""
    name = unit_name(job.name, unit.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(job, name, COMPONENT, **{UNIT_LABEL: unit.name}),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector(job.name, unit.name),
            "ports": [{"name": "dist", "port": env.DIST_PORT, "targetPort": "dist", "protocol": "TCP"}],
        },
    }


def build_pdb(job: JobRef, unit: LearnerUnit) -> dict[str, Any]:
    """Voluntary disruptions (drains) take a unit's pods one at a time."""
    name = unit_name(job.name, unit.name)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(job, name, COMPONENT, **{UNIT_LABEL: unit.name}),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(job.name, unit.name)}},
    }


def build_unit(
    job: JobRef, spec: DiLoCoJobSpec, unit: LearnerUnit, digest: str, *, stopped: bool
) -> list[dict[str, Any]]:
    return [
        build_headless_service(job, unit),
        build_statefulset(job, spec, unit, digest, stopped=stopped),
        build_pdb(job, unit),
    ]
