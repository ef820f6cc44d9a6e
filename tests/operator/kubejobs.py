"""Helpers of the operator's cluster tests: CRDs, job manifests, children and pods, KopfRunner."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import kopf
import yaml
from diloco_testbed.ports import free_port
from diloco_testbed.process import ManagedProcess
from diloco_testbed.waiting import wait_for
from kopf.testing import KopfRunner
from kubernetes import client as k8s
from kubernetes import watch
from kubernetes.client.exceptions import ApiException

ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "diloco.dev", "v1alpha1", "dilocojobs"
JOB_LABEL = "diloco.dev/job"


def install_crds(api_client: k8s.ApiClient) -> None:
    ext = k8s.ApiextensionsV1Api(api_client)
    for path in (ROOT / "crds").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            try:
                ext.create_custom_resource_definition(doc)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                current = ext.read_custom_resource_definition(doc["metadata"]["name"])
                doc["metadata"]["resourceVersion"] = current.metadata.resource_version
                ext.replace_custom_resource_definition(doc["metadata"]["name"], doc)
            name = doc["metadata"]["name"]
            wait_for(lambda name=name: established(ext, name), timeout=30, what=f"CRD {name}")


def established(ext: k8s.ApiextensionsV1Api, name: str) -> bool:
    crd = ext.read_custom_resource_definition(name)
    return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])


def operator_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.watching.server_timeout = 10
    settings.watching.client_timeout = 15
    settings.networking.request_timeout = 20
    return settings


def start_operator(*extra: str) -> KopfRunner:
    args = ["run", "--standalone", "--all-namespaces", "--verbose", *extra]
    return KopfRunner(args, timeout=60, settings=operator_settings())


def job_manifest(name: str, units: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "images": {"worker": "example.invalid/worker:test", "synchronizer": "example.invalid/sync:test"},
        "storage": {"bucket": "diloco-test"},
        "diloco": {"quorum": 1},
        "learnerUnits": units,
        "synchronizer": {"resources": {"requests": {"cpu": "10m"}}},
    }
    body.update(spec)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DiLoCoJob", "metadata": {"name": name}, "spec": body}


def unit(name: str, replicas: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "replicas": replicas,
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
        **extra,
    }


def create_job(api: k8s.ApiClient, ns: str, manifest: dict[str, Any]) -> None:
    k8s.CustomObjectsApi(api).create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, manifest)


def get_job(api: k8s.ApiClient, ns: str, name: str) -> dict[str, Any]:
    return dict(k8s.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name))


def patch_spec(api: k8s.ApiClient, ns: str, name: str, spec: dict[str, Any]) -> None:
    k8s.CustomObjectsApi(api).patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name, {"spec": spec})


def phase_is(api: k8s.ApiClient, ns: str, name: str, phase: str, units: str | None = None) -> bool:
    status = get_job(api, ns, name).get("status") or {}
    return status.get("phase") == phase and (units is None or status.get("unitsReady") == units)


def children(api: k8s.ApiClient, ns: str, job: str) -> dict[str, list[str]]:
    sel = f"{JOB_LABEL}={job}"
    core, apps, policy = k8s.CoreV1Api(api), k8s.AppsV1Api(api), k8s.PolicyV1Api(api)
    return {
        "Secret": sorted(o.metadata.name for o in core.list_namespaced_secret(ns, label_selector=sel).items),
        "ConfigMap": sorted(
            o.metadata.name for o in core.list_namespaced_config_map(ns, label_selector=sel).items
        ),
        "Service": sorted(
            o.metadata.name for o in core.list_namespaced_service(ns, label_selector=sel).items
        ),
        "Deployment": sorted(
            o.metadata.name for o in apps.list_namespaced_deployment(ns, label_selector=sel).items
        ),
        "StatefulSet": sorted(
            o.metadata.name for o in apps.list_namespaced_stateful_set(ns, label_selector=sel).items
        ),
        "PodDisruptionBudget": sorted(
            o.metadata.name
            for o in policy.list_namespaced_pod_disruption_budget(ns, label_selector=sel).items
        ),
    }


def expected_children(job: str, units: list[str]) -> dict[str, list[str]]:
    names = sorted(f"{job}-{u}" for u in units)
    return {
        "Secret": sorted([f"{job}-secret", *(f"{job}-{u}-token" for u in units)]),
        "ConfigMap": [f"{job}-config", f"{job}-revocations"],
        "Service": sorted([*names, f"{job}-sync"]),
        "Deployment": [f"{job}-sync"],
        "StatefulSet": names,
        "PodDisruptionBudget": names,
    }


def learner_pods(api: k8s.ApiClient, ns: str, job: str, unit_name: str | None = None) -> list[k8s.V1Pod]:
    sel = f"{JOB_LABEL}={job},app.kubernetes.io/component=learner"
    if unit_name:
        sel += f",diloco.dev/unit={unit_name}"
    return list(k8s.CoreV1Api(api).list_namespaced_pod(ns, label_selector=sel).items)


def running_on_kwok(pods: list[k8s.V1Pod], count: int) -> bool:
    live = [p for p in pods if p.metadata.deletion_timestamp is None]
    return len(live) == count and all(
        p.status.phase == "Running" and (p.spec.node_name or "").startswith("kwok-") for p in live
    )


def events(api: k8s.ApiClient, ns: str, job: str) -> list[str]:
    items = k8s.CoreV1Api(api).list_namespaced_event(ns, field_selector=f"involvedObject.name={job}").items
    return [e.reason for e in items]


class PodDeletions:
    """Watches pods (a label selector) and records how each was asked to go: pod name -> the
    ``deletionGracePeriodSeconds`` of the first event that shows its ``deletionTimestamp``; and
    every event in order as (name, uid, deleting, ready)."""

    def __init__(self, api: k8s.ApiClient, ns: str, selector: str) -> None:
        self.seen: dict[str, int | None] = {}
        self.timeline: list[tuple[str, str, bool, bool]] = []
        self.error: Exception | None = None
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, args=(api, ns, selector), daemon=True)
        self._started = threading.Event()

    def _run(self, api: k8s.ApiClient, ns: str, selector: str) -> None:
        core = k8s.CoreV1Api(api)
        rv = core.list_namespaced_pod(ns, label_selector=selector).metadata.resource_version
        self._started.set()
        try:
            for ev in self._watch.stream(
                core.list_namespaced_pod,
                ns,
                label_selector=selector,
                resource_version=rv,
                timeout_seconds=300,
            ):
                pod = ev["object"]
                ready = any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))
                self.timeline.append(
                    (pod.metadata.name, pod.metadata.uid, pod.metadata.deletion_timestamp is not None, ready)
                )
                if pod.metadata.deletion_timestamp is not None:
                    self.seen.setdefault(pod.metadata.name, pod.metadata.deletion_grace_period_seconds)
        except (
            Exception
        ) as exc:  # the stream closed under it (stopped, namespace deleted): kept for the report
            self.error = exc

    def __enter__(self) -> PodDeletions:
        self._thread.start()
        self._started.wait(timeout=30)
        return self

    def __exit__(self, *_: object) -> None:
        self._watch.stop()


def operator_process(
    name: str, kubeconfig: str | Path, args: Sequence[str], log: Path, env: Mapping[str, str] | None = None
) -> tuple[ManagedProcess, int]:
    """``diloco operator ARGS`` as a process (not yet started) with ``kubeconfig``, on its own liveness
    port (returned), without metrics, with a 2 s resync and ``env`` (e.g. the chart's variables)."""
    live_port = free_port()
    environ = {
        k: v for k, v in os.environ.items() if not k.startswith(("DILOCO_OPERATOR_", "KUBERNETES_SERVICE"))
    }
    environ.update(env or {})
    environ.update(
        {
            "KUBECONFIG": str(kubeconfig),
            "DILOCO_OPERATOR_RESYNC_SECONDS": "2",
            "DILOCO_OPERATOR_METRICS_PORT": "0",
            "DILOCO_OPERATOR_SYNC_URL": "http://127.0.0.1:9",  # no synchronizer runs on kwok
        }
    )
    argv = [sys.executable, "-m", "diloco", "operator", "--verbose", *args,
            f"--liveness=http://127.0.0.1:{live_port}/healthz"]  # fmt: skip
    return ManagedProcess(name, argv, log, env=environ), live_port
