"""The product installed as a user would: the operator from the Helm chart (SeaweedFS, the storage
Secret and the bucket are ``diloco_testbed.storage``'s), and a way to ask a job's synchronizer and
the cluster what they report (``kubectl get dilocojobs`` included)."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml
from diloco_core.auth import learner_token
from diloco_core.codec import decode
from diloco_core.request_proof import ProofAuth
from diloco_testbed.pki import Ca, issue_server_cert
from diloco_testbed.prereq import require_binary
from diloco_testbed.storage import BUCKET, ENDPOINT, S3_PORT, STORAGE_NAMESPACE
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from tests.e2e.cluster import E2ECluster

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "diloco"


TINY_MODEL = {"nLayer": 2, "nHead": 2, "nEmbd": 64, "blockSize": 64}
SMALL = {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"cpu": "1", "memory": "2Gi"}}


def tiny_job(e2e: E2ECluster, name: str, **spec: Any) -> dict[str, Any]:
    """A DiLoCoJob ``name`` of the built-in tiny GPT with the tests' images, on the tests' SeaweedFS,
    a step budget far away and a small synchronizer; ``spec`` adds fields or replaces them whole."""
    base = {
        "images": {"worker": e2e.images["worker"], "synchronizer": e2e.images["sync"],
                   "pullPolicy": "IfNotPresent"},
        "model": TINY_MODEL,
        "storage": {"endpoint": ENDPOINT, "bucket": BUCKET, "prefix": f"jobs/{name}",
                    "credentialsSecretRef": {"name": "diloco-s3"}},
        "diloco": {"innerSteps": 8, "fragments": 2, "overlap": 1, "quorum": 1},
        "synchronizer": {"resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}},
        "budget": {"steps": 1_000_000},
    }  # fmt: skip
    return {"apiVersion": "diloco.dev/v1alpha1", "kind": "DiLoCoJob", "metadata": {"name": name},
            "spec": {**base, **spec}}  # fmt: skip


def run_tool(name: str, *args: str, env: dict[str, str], timeout: float = 300) -> str:
    """Run kubectl or helm (the builds of scripts/build-test-binaries.sh); fail with its output."""
    done = subprocess.run([str(require_binary(name)), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, check=False)  # fmt: skip
    assert done.returncode == 0, f"{name} {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def running_pod_ip(core: k8s.CoreV1Api, ns: str, selector: str, what: str) -> str:
    """The address of a running pod that ``selector`` picks, and is not being deleted (the real node
    routes the pod subnet to this machine)."""
    pods = core.list_namespaced_pod(ns, label_selector=selector).items
    running = [p for p in pods if p.status.phase == "Running" and p.status.pod_ip
               and not p.metadata.deletion_timestamp]  # fmt: skip
    assert running, f"no running {what} pod"
    return str(running[0].status.pod_ip)


def seaweedfs_url(api: k8s.ApiClient) -> str:
    """SeaweedFS's S3 endpoint as this machine reaches it: its pod's address."""
    return f"http://{running_pod_ip(k8s.CoreV1Api(api), STORAGE_NAMESPACE, 'app=seaweedfs', 'SeaweedFS')}:{S3_PORT}"


def create_tls_secret(
    api: k8s.ApiClient, ns: str, name: str, ca: Ca, names: list[str], workdir: Path
) -> None:
    """A Secret of type kubernetes.io/tls as cert-manager writes it (tls.crt, tls.key, ca.crt): a
    serving certificate for ``names`` signed by ``ca``."""
    cert, key = issue_server_cert(ca, workdir, name, names)
    k8s.CoreV1Api(api).create_namespaced_secret(ns, {
        "metadata": {"name": name}, "type": "kubernetes.io/tls",
        "stringData": {"tls.crt": cert.read_text(), "tls.key": key.read_text(), "ca.crt": ca.cert.read_text()},
    })  # fmt: skip


def create_ca_config_map(api: k8s.ApiClient, ns: str, name: str, ca: Ca) -> None:
    """The CA certificate alone (never its key), as another region receives it: key ``ca.crt``."""
    k8s.CoreV1Api(api).create_namespaced_config_map(ns, {"metadata": {"name": name},
                                                         "data": {"ca.crt": ca.cert.read_text()}})  # fmt: skip


def helm_install_operator(e2e: E2ECluster, tmp: Path, watch: list[str]) -> str:
    """The chart, installed with the test images; the operator runs as a pod. Returns its namespace."""
    ns = e2e.new_namespace("system")
    repository, _, tag = e2e.images["sync"].rpartition(":")
    values = {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "IfNotPresent"},
        "watchNamespaces": watch,
        "operator": {"resyncSeconds": 5, "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}}},
    }
    path = tmp / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    run_tool("helm", "install", "diloco", str(CHART), "--namespace", ns, "--values", str(path), "--wait",
             "--timeout", "5m", env=e2e.kube.env())  # fmt: skip
    return ns


def helm_uninstall(e2e: E2ECluster, ns: str) -> None:
    run_tool("helm", "uninstall", "diloco", "--namespace", ns, "--wait", env=e2e.kube.env())


def printed_columns(e2e: E2ECluster, ns: str, name: str) -> dict[str, str]:
    """What `kubectl get dilocojobs NAME` prints, column by column."""
    out = run_tool("kubectl", "get", "dilocojobs", name, "-n", ns, env=e2e.kube.env(), timeout=60)
    header, row = out.rstrip("\n").splitlines()[:2]
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    bounds = [*starts[1:], None]
    return {header[a:b].strip(): row[a:b].strip() for a, b in zip(starts, bounds, strict=True)}


class Synchronizer:
    """A job's synchronizer, asked at its pod's address (the real node routes the pod subnet here).

    With ``ca`` (a synchronizer serving HTTPS) its certificate is checked against that CA, under the
    name of its Service (``<job>-sync.<namespace>.svc``), which the pod's address is not."""

    def __init__(self, api: k8s.ApiClient, ns: str, job: str, ca: Path | None = None) -> None:
        self.core, self.ns, self.job = k8s.CoreV1Api(api), ns, job
        self.verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(ca)) if ca else True
        self.scheme = "https" if ca else "http"

    def url(self) -> str:
        selector = f"diloco.dev/job={self.job},app.kubernetes.io/component=synchronizer"
        return f"{self.scheme}://{running_pod_ip(self.core, self.ns, selector, 'synchronizer')}:8080"

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        extensions = {"sni_hostname": f"{self.job}-sync.{self.ns}.svc"} if self.scheme == "https" else {}
        with httpx.Client(verify=self.verify) as client:
            return client.get(f"{self.url()}{path}", extensions=extensions, **kwargs)

    def status(self) -> dict[str, Any]:
        response = self.get("/v1/status", timeout=10)
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    def versions(self) -> dict[int, int]:
        return {f["fragment"]: f["version"] for f in self.status()["fragments"]}

    def global_params(self) -> dict[str, np.ndarray]:
        secret = self.core.read_namespaced_secret(f"{self.job}-secret", self.ns).data["job-secret"]
        import base64

        job_secret = base64.b64decode(secret).decode()
        auth = ProofAuth(learner_token(job_secret, "e2e-observer"))
        headers = {"X-DiLoCo-Learner": "e2e-observer"}
        out: dict[str, np.ndarray] = {}
        for p in self.versions():
            r = self.get(
                f"/v1/fragments/{p}",
                params={"newer_than": -1, "wait": 0},
                headers=headers,
                auth=auth,
                timeout=30,
            )
            assert r.status_code == 200, r.text
            out.update(decode(r.content).tensors)
        return out


def job_status(api: k8s.ApiClient, ns: str, name: str) -> dict[str, Any]:
    obj = k8s.CustomObjectsApi(api).get_namespaced_custom_object(
        "diloco.dev", "v1alpha1", ns, "dilocojobs", name
    )
    return dict(obj.get("status") or {})


def warning_events(api: k8s.ApiClient, ns: str, kind: str = "DiLoCoJob") -> list[str]:
    """The Warning events about objects of ``kind`` (the operator's, on its jobs). The kubelet's own
    (a readiness probe failing while a pod starts, say) are not the job's business."""
    events = k8s.CoreV1Api(api).list_namespaced_event(ns).items  # events.k8s.io ones included
    return [f"{e.involved_object.kind}/{e.involved_object.name} {e.reason}: {e.message}"
            for e in events if e.type == "Warning" and e.involved_object.kind == kind]  # fmt: skip


def restarts(api: k8s.ApiClient, ns: str) -> dict[str, int]:
    pods = k8s.CoreV1Api(api).list_namespaced_pod(ns).items
    return {p.metadata.name: sum(c.restart_count for c in p.status.container_statuses or []) for p in pods}


def exists(fn: Any, *args: Any) -> bool:
    try:
        fn(*args)
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True
