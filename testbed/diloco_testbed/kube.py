"""A Kubernetes cluster for tests: a real control plane started here, or an existing cluster.

`connect_cluster()` returns a `ControlPlane` (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok as plain processes on free loopback ports, with kwok nodes) or, when
DILOCO_TEST_KUBECONFIG names a kubeconfig (a kind cluster, say), an `ExistingCluster`.
"""

from __future__ import annotations

import base64
import os
import secrets
import ssl
from pathlib import Path
from typing import Any

import httpx
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException

from . import kwok
from .pki import Pki, make_pki
from .ports import LOOPBACK, free_ports
from .prereq import bin_dir, require_binary, unavailable
from .process import ManagedProcess, await_started, stop_all

START_TIMEOUT = 240.0  # seconds; generous, the machine may be busy


class Cluster:
    """What tests use: a kubeconfig, API clients and namespaces."""

    has_kwok = False
    bin_dir: Path | None = None

    def __init__(self, kubeconfig: Path) -> None:
        self._kubeconfig = kubeconfig
        self.node_names: list[str] = []

    @property
    def kubeconfig(self) -> str:
        return str(self._kubeconfig)

    @property
    def server(self) -> str:
        data = yaml.safe_load(self._kubeconfig.read_text())
        current = data.get("current-context")
        ctx = next(
            (c["context"] for c in data["contexts"] if c["name"] == current), data["contexts"][0]["context"]
        )
        return str(next(c["cluster"]["server"] for c in data["clusters"] if c["name"] == ctx["cluster"]))

    def api_client(self) -> k8s.ApiClient:
        return k8s_config.new_client_from_config(config_file=self.kubeconfig)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment for child processes (kubectl, helm, the operator) pointing at this cluster."""
        env = dict(os.environ if base is None else base)
        env["KUBECONFIG"] = self.kubeconfig
        return env

    def create_namespace(self, prefix: str = "t") -> str:
        name = f"{prefix[:50].rstrip('-')}-{secrets.token_hex(4)}"
        with self.api_client() as api:
            body = k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=name, labels={"diloco-test": "true"}))
            k8s.CoreV1Api(api).create_namespace(body)
        return name

    def delete_namespace(self, name: str) -> None:
        """Start deleting the namespace (its contents go with it); does not wait."""
        with self.api_client() as api:
            try:
                k8s.CoreV1Api(api).delete_namespace(name, propagation_policy="Background")
            except ApiException as exc:
                if exc.status != 404:
                    raise

    def close(self) -> None:
        pass


class ExistingCluster(Cluster):
    def __init__(self, kubeconfig: Path) -> None:
        super().__init__(kubeconfig)
        self.bin_dir = bin_dir()  # helm and friends, when built
        try:
            with self.api_client() as api:
                nodes = k8s.CoreV1Api(api).list_node().items
        except Exception as exc:
            unavailable(f"cannot reach the cluster of DILOCO_TEST_KUBECONFIG={kubeconfig}: {exc}")
        self.node_names = [n.metadata.name for n in nodes]
        print(f"[kube] using the existing cluster {self.server} ({len(nodes)} nodes)")


class ControlPlane(Cluster):
    """etcd + kube-apiserver + controller-manager + scheduler + kwok, torn down by PID.

    ``extra_args``: more flags for a component, by binary name (a benchmark lifting the
    controller-manager's client rate limit, say).
    """

    has_kwok = True

    def __init__(
        self, workdir: Path, *, with_kwok: bool = True, extra_args: dict[str, list[str]] | None = None
    ) -> None:
        super().__init__(workdir / "kubeconfig.yaml")
        self.extra_args = dict(extra_args or {})
        self.workdir = workdir
        self.bin_dir = bin_dir()
        self.has_kwok = with_kwok
        names = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler") + (
            ("kwok",) * with_kwok
        )
        self.binaries = {name: require_binary(name) for name in names}
        names = ("etcd_client", "etcd_peer", "apiserver", "controller_manager", "scheduler")
        self.ports = dict(zip(names, free_ports(len(names)), strict=True))
        self.token = secrets.token_hex(16)
        self.processes: list[ManagedProcess] = []
        self.pki: Pki | None = None

    @property
    def url(self) -> str:
        return f"https://{LOOPBACK}:{self.ports['apiserver']}"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        print(f"[kube] starting a control plane in {self.workdir} (logs: {self.workdir}/*.log)")
        try:
            pki = self.pki = make_pki(self.workdir / "pki")
            self._write_kubeconfig(pki)
            self._start_etcd()
            self._start_apiserver(pki)
            self._start_components(pki)
            if self.has_kwok:
                self._create_nodes()
        except BaseException:
            self.close()
            raise
        print(f"[kube] control plane ready at {self.url}, nodes {', '.join(self.node_names) or '(none yet)'}")

    def close(self) -> None:
        stop_all(self.processes)
        self.processes.clear()

    def _spawn(self, name: str, argv: list[str]) -> ManagedProcess:
        argv = [*argv, *self.extra_args.get(name, [])]
        proc = ManagedProcess(name, [str(self.binaries[name]), *argv], self.workdir / f"{name}.log")
        proc.start()
        self.processes.append(proc)
        return proc

    def _await(self, proc: ManagedProcess, probe: Any, what: str) -> None:
        await_started(
            proc, probe, what=what, timeout=START_TIMEOUT, failure="the test control plane did not start"
        )

    def _write_kubeconfig(self, pki: Pki) -> None:
        (self.workdir / "tokens.csv").write_text(f'{self.token},diloco-test-admin,1000,"system:masters"\n')
        ca = base64.b64encode(pki.ca_cert.read_bytes()).decode()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "test", "cluster": {"server": self.url, "certificate-authority-data": ca}}],
            "users": [{"name": "admin", "user": {"token": self.token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin"}}],
            "current-context": "test",
        }
        self._kubeconfig.write_text(yaml.safe_dump(config))

    def _start_etcd(self) -> None:
        client = f"http://{LOOPBACK}:{self.ports['etcd_client']}"
        peer = f"http://{LOOPBACK}:{self.ports['etcd_peer']}"
        proc = self._spawn("etcd", [
            "--name=test", f"--data-dir={self.workdir / 'etcd-data'}",
            f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=test={peer}", "--unsafe-no-fsync=true", "--log-level=warn",
        ])  # fmt: skip
        self._await(proc, lambda: httpx.get(f"{client}/health", timeout=2).json()["health"] == "true", "etcd")

    def _start_apiserver(self, pki: Pki) -> None:
        proc = self._spawn("kube-apiserver", [
            f"--etcd-servers=http://{LOOPBACK}:{self.ports['etcd_client']}",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--tls-cert-file={pki.server_cert}", f"--tls-private-key-file={pki.server_key}",
            f"--client-ca-file={pki.ca_cert}",
            f"--bind-address={LOOPBACK}", f"--advertise-address={LOOPBACK}",
            f"--secure-port={self.ports['apiserver']}",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}", f"--service-account-signing-key-file={pki.sa_key}",
            f"--token-auth-file={self.workdir / 'tokens.csv'}",
            "--authorization-mode=RBAC", "--allow-privileged=true",
            # PodNodeSelector and PodTolerationRestriction: a namespace's annotations place its pods
            # (a real node's tests); the `kubernetes` Service's endpoint is written by a real node
            # (it reaches the apiserver through a relay, not at this loopback address)
            "--enable-admission-plugins=PodNodeSelector,PodTolerationRestriction",
            # a real node's kubelet (logs, exec) is reached at its address, as the apiserver's client
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            f"--kubelet-client-certificate={pki.kubelet_client_cert}", f"--kubelet-client-key={pki.kubelet_client_key}",
            "--endpoint-reconciler-type=none",
            "--enable-priority-and-fairness=false", "--profiling=false",
        ])  # fmt: skip
        headers = {"Authorization": f"Bearer {self.token}"}
        trusted = ssl.create_default_context(cafile=str(pki.ca_cert))

        def ready() -> bool:
            response = httpx.get(f"{self.url}/readyz", headers=headers, verify=trusted, timeout=5)
            return response.status_code == 200

        self._await(proc, ready, f"kube-apiserver /readyz at {self.url}")

    def _start_components(self, pki: Pki) -> None:
        kubeconfig_flags = [
            f"--{kind}={self.kubeconfig}"
            for kind in ("kubeconfig", "authentication-kubeconfig", "authorization-kubeconfig")
        ]
        common = [*kubeconfig_flags, "--leader-elect=false", f"--bind-address={LOOPBACK}"]
        cm = self._spawn("kube-controller-manager", [
            *common, f"--secure-port={self.ports['controller_manager']}",
            f"--cert-dir={self.workdir / 'controller-manager-certs'}",
            f"--service-account-private-key-file={pki.sa_key}", f"--root-ca-file={pki.ca_cert}",
            f"--cluster-signing-cert-file={pki.ca_cert}", f"--cluster-signing-key-file={pki.ca_key}",
        ])  # fmt: skip
        sched = self._spawn("kube-scheduler", [
            *common, f"--secure-port={self.ports['scheduler']}", f"--cert-dir={self.workdir / 'scheduler-certs'}",
        ])  # fmt: skip
        if self.has_kwok:
            stages = kwok.write_config(bin_dir() / "kwok-stages", self.workdir / "kwok.yaml")
            self._spawn("kwok", [
                f"--kubeconfig={self.kubeconfig}", f"--config={stages}", "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={kwok.NODE_SELECTOR}",
                "--cidr=10.244.0.1/16", "--node-lease-duration-seconds=40",
            ])  # fmt: skip
        for proc, port in ((cm, self.ports["controller_manager"]), (sched, self.ports["scheduler"])):
            url = f"https://{LOOPBACK}:{port}/healthz"
            self._await(
                proc,
                lambda url=url: httpx.get(url, verify=False, timeout=5).status_code == 200,
                f"{proc.name} {url}",
            )

    def _create_nodes(self) -> None:
        kwok_proc = next(p for p in self.processes if p.name == "kwok")
        with self.api_client() as api:
            core = k8s.CoreV1Api(api)
            for node in kwok.DEFAULT_NODES:
                core.create_node(kwok.node_manifest(node))
            self.node_names = [n.name for n in kwok.DEFAULT_NODES]

            def all_ready() -> bool:
                nodes = core.list_node(label_selector="type=kwok").items
                ready = [
                    n
                    for n in nodes
                    if any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])
                ]
                return len(ready) == len(kwok.DEFAULT_NODES)

            self._await(kwok_proc, all_ready, "kwok nodes to become Ready")


def connect_cluster(workdir: Path) -> Cluster:
    existing = os.environ.get("DILOCO_TEST_KUBECONFIG")
    if existing:
        path = Path(existing).expanduser()
        if not path.is_file():
            unavailable(f"DILOCO_TEST_KUBECONFIG={existing} is not a file")
        return ExistingCluster(path)
    plane = ControlPlane(workdir)
    plane.start()
    return plane
