"""The checks of a job's spec against the cluster, before anything is built from it: what no
schema can say (``validate_job``), what a queue needs, and that every object the spec names
exists (Secrets and ConfigMaps with their keys, ServiceAccounts, PriorityClasses, the LocalQueue).
SpecError says what is wrong; the job is then Failed with that message until it is fixed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException

from diloco_operator.builders.names import JobRef
from diloco_operator.kube import Kube
from diloco_operator.runtime.queue import queue_problem, with_job_queue
from diloco_operator.schema.references import (
    config_map_references,
    pod_settings_references,
    secret_references,
)
from diloco_operator.schema.spec import DiLoCoJobSpec, SpecError, parse_spec, validate_job
from diloco_operator.status.admission import WORKLOAD_API


def check_spec(
    kube: Kube, job: JobRef, raw: Mapping[str, Any], meta: Mapping[str, Any] | None = None
) -> DiLoCoJobSpec:
    """Parse, validate and check the references of the spec (with the queue the job's ``meta``
    labels name, ``queue.with_job_queue``); SpecError says what is wrong."""
    spec = with_job_queue(parse_spec(dict(raw)), meta or {})
    validate_job(job.name, spec)
    problem = queue_problem(spec)
    if problem is not None:
        raise SpecError(problem)
    for kind, references in (("Secret", secret_references(spec)), ("ConfigMap", config_map_references(spec))):
        for name, key in references:
            found = kube.get("v1", kind, job.namespace, name)
            if found is None:
                raise SpecError(
                    f"{kind} '{name}' referenced by the spec does not exist in namespace {job.namespace}"
                )
            if key not in (found.get("data") or {}):
                raise SpecError(f"{kind} '{name}' has no key '{key}' that the spec refers to")
    check_pod_references(kube, job, spec)
    if spec.queue_name and kube.get(WORKLOAD_API, "LocalQueue", job.namespace, spec.queue_name) is None:
        raise SpecError(
            f"LocalQueue '{spec.queue_name}' (spec.queueName) does not exist in namespace {job.namespace}, "
            "or Kueue is not installed in the cluster"
        )
    return spec


def check_pod_references(kube: Kube, job: JobRef, spec: DiLoCoJobSpec) -> None:
    """The ServiceAccounts and PriorityClasses the pods name exist: the apiserver refuses a pod that
    names a missing one, and its unit would wait with no pod and no reason. An operator that may not
    read PriorityClasses (one watching named namespaces only) leaves those to the apiserver."""
    accounts, classes = pod_settings_references(spec)
    for name in accounts:
        if kube.get("v1", "ServiceAccount", job.namespace, name) is None:
            raise SpecError(
                f"ServiceAccount '{name}' named by the spec's pods does not exist in namespace {job.namespace}"
            )
    for name in classes:
        try:
            found = kube.get("scheduling.k8s.io/v1", "PriorityClass", "", name)
        except ApiException as exc:
            if exc.status == 403:
                continue
            raise
        if found is None:
            raise SpecError(f"PriorityClass '{name}' named by the spec's pods does not exist in the cluster")
