"""The jobs of examples/, applied as a user would: with `kubectl apply`, only the images overridden
(spec.images, the way docs/images.md says), where an example names a storage or synchronizer
outside this cluster, those pointed at the ones here, and a synchronizer's requests cut to what
this one small node can give. Their learner units ask for GPUs or regions this node does not have,
so their learners stay Pending: what is checked is that the API takes the jobs, the operator builds
every child, and each synchronizer starts on the example's own settings and reports to its job."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml
from diloco_testbed.pki import make_ca
from diloco_testbed.storage import BUCKET, ENDPOINT
from diloco_testbed.waiting import wait_for
from kubernetes import client as k8s

from tests.e2e.cluster import E2ECluster
from tests.e2e.stack import (
    create_ca_config_map,
    create_tls_secret,
    job_status,
    run_tool,
)

pytestmark = [pytest.mark.integration, pytest.mark.e2e]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _with_test_images(e2e: E2ECluster, job: dict[str, Any]) -> dict[str, Any]:
    job["spec"]["images"] = {"worker": e2e.images["worker"], "synchronizer": e2e.images["sync"],
                             "pullPolicy": "IfNotPresent"}  # fmt: skip
    return job


def _condition(status: dict[str, Any], ctype: str) -> str | None:
    return next((c["status"] for c in status.get("conditions") or [] if c["type"] == ctype), None)


def _apply(e2e: E2ECluster, ns: str, docs: list[dict[str, Any]], tmp_path: Path) -> Path:
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    run_tool("kubectl", "apply", "-n", ns, "-f", str(path), env=e2e.kube.env())
    return path


def _children_built(api: k8s.ApiClient, ns: str, job: dict[str, Any]) -> bool:
    apps = k8s.AppsV1Api(api)
    name = job["metadata"]["name"]
    units = {f"{name}-{u['name']}" for u in job["spec"]["learnerUnits"]}
    sets = {
        s.metadata.name
        for s in apps.list_namespaced_stateful_set(ns, label_selector=f"diloco.dev/job={name}").items
    }
    return units <= sets


@pytest.mark.timeout(1200)  # the first e2e test also starts the node, SeaweedFS and the operator
def test_single_region_example_is_built_and_its_synchronizer_serves(
    e2e: E2ECluster, api: k8s.ApiClient, storage_secret: str, jobs_namespace: str, operator: str, tmp_path: Path,
) -> None:  # fmt: skip
    (job,) = yaml.safe_load_all((EXAMPLES / "single-region.yaml").read_text())
    assert job["spec"]["storage"]["endpoint"] == ENDPOINT  # the example's storage is the one deployed here
    assert job["spec"]["storage"]["credentialsSecretRef"]["name"] == storage_secret
    assert job["spec"]["storage"]["bucket"] == BUCKET
    job["spec"]["synchronizer"]["resources"] = {
        "requests": {"cpu": "100m", "memory": "256Mi"}
    }  # 2 cores here
    path = _apply(e2e, jobs_namespace, [_with_test_images(e2e, job)], tmp_path)
    name = job["metadata"]["name"]
    wait_for(lambda: _children_built(api, jobs_namespace, job), timeout=120, what="the example's children")
    status = wait_for(lambda: (s := job_status(api, jobs_namespace, name)) and _condition(s, "SynchronizerReady") == "True"
                      and s, timeout=300, what="the example's synchronizer ready",
                      describe=lambda: str(job_status(api, jobs_namespace, name)))  # fmt: skip
    assert status["phase"] == "Pending", status  # its GPU units cannot run on this node
    assert status["unitsReady"] == "0/3", status
    run_tool("kubectl", "delete", "-n", jobs_namespace, "-f", str(path), "--wait=true", env=e2e.kube.env())


@pytest.mark.timeout(1200)
def test_multi_region_example_region_b_reports_region_a_synchronizer(
    e2e: E2ECluster, api: k8s.ApiClient, storage_secret: str, jobs_namespace: str, operator: str, tmp_path: Path,
) -> None:  # fmt: skip
    region_a, region_b = yaml.safe_load_all((EXAMPLES / "multi-region.yaml").read_text())
    for job in (region_a, region_b):
        _with_test_images(e2e, job)
        job["spec"]["storage"].update({"endpoint": ENDPOINT, "region": "us-east-1", "bucket": BUCKET})  # here
    core = k8s.CoreV1Api(api)
    a = region_a["metadata"]["name"]
    # the certificates the example names: region A's synchronizer serves HTTPS with a certificate for
    # its Service; region B receives the CA certificate alone, as a ConfigMap
    ca = make_ca(tmp_path / "ca")
    a_sync = f"{a}-sync.{jobs_namespace}.svc"
    create_tls_secret(api, jobs_namespace, region_a["spec"]["synchronizer"]["tls"]["secretName"], ca, [a_sync],
                      tmp_path / "pki")  # fmt: skip
    create_ca_config_map(api, jobs_namespace, region_b["spec"]["synchronizer"]["ca"]["configMapName"], ca)
    path = _apply(e2e, jobs_namespace, [region_a], tmp_path)
    wait_for(lambda: _condition(job_status(api, jobs_namespace, a), "SynchronizerReady") == "True", timeout=300,
             what="region A's synchronizer ready", describe=lambda: str(job_status(api, jobs_namespace, a)))  # fmt: skip
    # as the example says: region A's job secret is copied to region B, which points at A's synchronizer
    secret = core.read_namespaced_secret(f"{a}-secret", jobs_namespace).data["job-secret"]
    ref = region_b["spec"]["synchronizer"]["external"]["tokenSecretRef"]
    core.create_namespaced_secret(jobs_namespace, {"metadata": {"name": ref["name"]},
                                                   "stringData": {ref["key"]: base64.b64decode(secret).decode()}})  # fmt: skip
    region_b["spec"]["synchronizer"]["external"]["url"] = f"https://{a_sync}:8080"
    path_b = tmp_path / "b"
    path_b.mkdir()
    _apply(e2e, jobs_namespace, [region_b], path_b)
    b = region_b["metadata"]["name"]
    status = wait_for(lambda: (s := job_status(api, jobs_namespace, b)) and _condition(s, "SynchronizerReady") == "True"
                      and s, timeout=180, what="region B reads region A's synchronizer over HTTPS",
                      describe=lambda: str(job_status(api, jobs_namespace, b)))  # fmt: skip
    # the job's progress, from A's synchronizer (its version only once a fragment has parameters)
    assert {"rounds", "tokens"} <= status.keys(), status
    assert (
        not k8s.AppsV1Api(api)
        .list_namespaced_deployment(jobs_namespace, label_selector=f"diloco.dev/job={b}")
        .items
    )
    run_tool("kubectl", "delete", "-n", jobs_namespace, "-f", str(path_b / "jobs.yaml"), "--wait=true",
             env=e2e.kube.env())  # fmt: skip
    run_tool("kubectl", "delete", "-n", jobs_namespace, "-f", str(path), "--wait=true", env=e2e.kube.env())
    core.delete_namespaced_secret(region_a["spec"]["synchronizer"]["tls"]["secretName"], jobs_namespace)
    core.delete_namespaced_config_map(region_b["spec"]["synchronizer"]["ca"]["configMapName"], jobs_namespace)
