"""Kueue (sigs.k8s.io/kueue, built by scripts/build-test-binaries.sh with its CRDs and webhook
manifests) run against a test control plane, as a platform team runs it, webhooks included.

Its webhooks are served on the loopback with a throw-away certificate, and reach only namespaces
labelled ``diloco-kueue=true`` (``NAMESPACE_LABEL``): the rest of a shared test cluster never
calls them. Its manager runs with the ``batch/job``, ``pod`` and ``statefulset`` integrations,
without leader election, internal certificate management or the visibility server.
"""

from __future__ import annotations

import base64
import shutil
from pathlib import Path
from typing import Any

import httpx
import yaml
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from .kube import Cluster
from .kueue_objects import API, NAMESPACE_LABEL, cluster_queue, kueue_object, label_for_kueue
from .pki import issue_server_cert, make_ca
from .ports import LOOPBACK, free_ports
from .prereq import BUILD_HINT, bin_dir, require_binary, unavailable
from .process import ManagedProcess, await_started
from .waiting import wait_for

KUEUE_NAMESPACE = "kueue-system"
FRAMEWORKS = ("batch/job", "pod", "statefulset")
START_TIMEOUT = 120.0


def manifests_dir() -> Path:
    folder = bin_dir() / "kueue-manifests"
    if not (folder / "webhooks.yaml").is_file():
        unavailable(f"Kueue's manifests are missing from {folder}: {BUILD_HINT}")
    return folder


def webhook_configurations(text: str, url: str, ca_pem: bytes) -> list[dict[str, Any]]:
    """Kueue's webhook configurations pointed at ``url`` (its webhook server) and limited to the
    namespaces labelled ``NAMESPACE_LABEL`` (cluster-scoped objects always reach them)."""
    out = []
    ca = base64.b64encode(ca_pem).decode()
    for doc in yaml.safe_load_all(text):
        if not doc:
            continue
        doc["metadata"] = {"name": f"kueue-{doc['metadata']['name']}"}
        for hook in doc.get("webhooks") or []:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"{url}{path}", "caBundle": ca}
            hook["namespaceSelector"] = {"matchLabels": {NAMESPACE_LABEL: "true"}}
        out.append(doc)
    return out


def manager_config(webhook_port: int, health_port: int, metrics_port: int, cert_dir: Path) -> dict[str, Any]:
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "health": {"healthProbeBindAddress": f"{LOOPBACK}:{health_port}"},
        "metrics": {"bindAddress": f"{LOOPBACK}:{metrics_port}"},
        "webhook": {"port": webhook_port, "host": LOOPBACK, "certDir": str(cert_dir)},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "managedJobsNamespaceSelector": {"matchLabels": {NAMESPACE_LABEL: "true"}},
        "integrations": {"frameworks": list(FRAMEWORKS)},
    }


# Without its internal certificate management, Kueue's manager reads its metrics server's
# certificate from this fixed folder (cmd/kueue/main.go) and exits when there is none.
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")


def provide_metrics_cert(crt: Path, key: Path) -> None:
    """Put a certificate where Kueue's manager looks for its metrics server's (any will do: the
    tests do not scrape it); one already there is kept."""
    if (METRICS_CERT_DIR / "tls.crt").is_file() and (METRICS_CERT_DIR / "tls.key").is_file():
        return
    try:
        METRICS_CERT_DIR.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(crt, METRICS_CERT_DIR / "tls.crt")
        shutil.copyfile(key, METRICS_CERT_DIR / "tls.key")
    except OSError as exc:
        unavailable(
            f"Kueue's manager needs a certificate in {METRICS_CERT_DIR} (tls.crt, tls.key) and it cannot "
            f"be written here ({exc}): create that folder writable for this user, or run as root"
        )


class Kueue:
    """Kueue's CRDs, webhooks and manager on ``cluster``; ``stop()`` ends the manager and removes
    its webhooks (the CRDs stay)."""

    def __init__(self, cluster: Cluster, workdir: Path) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.binary = require_binary("kueue")
        self.manifests = manifests_dir()
        self.webhook_port, self.health_port, self.metrics_port = free_ports(3)
        self.process: ManagedProcess | None = None

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        certs = self.workdir / "certs"
        ca = make_ca(self.workdir / "ca", "diloco-test-kueue-ca")
        crt, key = issue_server_cert(ca, certs, "tls", [LOOPBACK])
        provide_metrics_cert(crt, key)
        with self.cluster.api_client() as api:
            self._install(api, ca.cert.read_bytes())
        config = self.workdir / "config.yaml"
        config.write_text(
            yaml.safe_dump(manager_config(self.webhook_port, self.health_port, self.metrics_port, certs))
        )
        self.process = ManagedProcess(
            "kueue",
            [
                self.binary,
                f"--config={config}",
                "--feature-gates=VisibilityOnDemand=false",
                "--zap-log-level=2",
            ],
            self.workdir / "kueue.log",
            env=self.cluster.env(),
        )
        self.process.start()
        ready = f"http://{LOOPBACK}:{self.health_port}/readyz"
        await_started(
            self.process,
            lambda: httpx.get(ready, timeout=2).status_code == 200,
            what=f"Kueue's readiness at {ready}",
            timeout=START_TIMEOUT,
            failure="Kueue did not start",
        )
        with self.cluster.api_client() as api:
            await_started(
                self.process,
                lambda: self._webhooks_answer(api),
                what="Kueue's webhooks to answer",
                timeout=START_TIMEOUT,
                failure="Kueue's webhooks did not answer",
            )

    def stop(self) -> None:
        """End the manager and remove its webhook configurations (nothing calls a dead server)."""
        if self.process is not None:
            self.process.stop()
        with self.cluster.api_client() as api:
            hooks = k8s.AdmissionregistrationV1Api(api)
            for delete in (
                hooks.delete_mutating_webhook_configuration,
                hooks.delete_validating_webhook_configuration,
            ):
                for name in (
                    "kueue-mutating-webhook-configuration",
                    "kueue-validating-webhook-configuration",
                ):
                    try:
                        delete(name)
                    except ApiException as exc:
                        if exc.status != 404:
                            raise

    def _install(self, api: k8s.ApiClient, ca_pem: bytes) -> None:
        ext = k8s.ApiextensionsV1Api(api)
        for path in sorted(self.manifests.glob("kueue.x-k8s.io_*.yaml")):
            crd = yaml.safe_load(path.read_text())
            try:
                ext.create_custom_resource_definition(crd)
            except ApiException as exc:
                if exc.status != 409:
                    raise
        for path in sorted(self.manifests.glob("kueue.x-k8s.io_*.yaml")):
            name = yaml.safe_load(path.read_text())["metadata"]["name"]
            wait_for(
                lambda name=name: any(
                    c.type == "Established" and c.status == "True"
                    for c in ext.read_custom_resource_definition(name).status.conditions or []
                ),
                timeout=60,
                what=f"the CRD {name} to be established",
            )
        core = k8s.CoreV1Api(api)
        try:
            core.create_namespace({"metadata": {"name": KUEUE_NAMESPACE}})
        except ApiException as exc:
            if exc.status != 409:
                raise
        url = f"https://{LOOPBACK}:{self.webhook_port}"
        hooks = k8s.AdmissionregistrationV1Api(api)
        for doc in webhook_configurations((self.manifests / "webhooks.yaml").read_text(), url, ca_pem):
            create, delete = (
                (hooks.create_mutating_webhook_configuration, hooks.delete_mutating_webhook_configuration)
                if doc["kind"] == "MutatingWebhookConfiguration"
                else (
                    hooks.create_validating_webhook_configuration,
                    hooks.delete_validating_webhook_configuration,
                )
            )
            try:
                delete(doc["metadata"]["name"])  # one left by an earlier run points at another port
            except ApiException as exc:
                if exc.status != 404:
                    raise
            create(doc)

    @staticmethod
    def _webhooks_answer(api: k8s.ApiClient) -> bool:
        """A dry-run ResourceFlavor goes through Kueue's webhooks (refused while they do not answer)."""
        flavor = kueue_object("ResourceFlavor", "probe")
        try:
            k8s.CustomObjectsApi(api).create_cluster_custom_object(
                *API, "resourceflavors", flavor, dry_run="All"
            )
        except ApiException:
            return False
        return True


def local_queues(api: k8s.ApiClient, node: str, namespaces: list[str]) -> str:
    """A ResourceFlavor ``default``, a ClusterQueue ``local`` with ``node``'s CPU and memory as its
    quota, and a LocalQueue ``local`` in each of ``namespaces`` (labelled for Kueue's webhooks);
    says what was made."""
    custom = k8s.CustomObjectsApi(api)
    allocatable = k8s.CoreV1Api(api).read_node(node).status.allocatable
    cpu, memory = allocatable["cpu"], allocatable["memory"]
    custom.create_cluster_custom_object(*API, "resourceflavors", kueue_object("ResourceFlavor", "default"))
    queue = cluster_queue("local", "default", {"cpu": cpu, "memory": memory})
    custom.create_cluster_custom_object(*API, "clusterqueues", queue)
    for namespace in namespaces:
        label_for_kueue(api, namespace)
        local = kueue_object("LocalQueue", "local", spec={"clusterQueue": "local"})
        custom.create_namespaced_custom_object(*API, namespace, "localqueues", local)
    where = (
        f"LocalQueue local in {', '.join(namespaces)}"
        if namespaces
        else "no LocalQueue (no --storage namespace)"
    )
    return f"ClusterQueue local ({cpu} CPU, {memory} memory), {where}"
