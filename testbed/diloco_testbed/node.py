"""A real Kubernetes node for tests: pods that run processes, next to the test control plane.

containerd, runc and the CNI plugins come from Debian's packages; kubelet, kube-proxy and CoreDNS are
built from the Go module proxy (scripts/build-test-binaries.sh); the pod sandbox and the project's
images are built by scripts/build-test-images.sh and imported into this node's containerd.

Everything the node needs lives in a numbered *instance* of its own, so that two nodes (of two
control planes) can run on one machine: instance ``i`` has

- a network namespace ``diloco-n<i>``, joined to this machine's by the veth pair ``dlc-h<i>``
  (10.235.<i>.1, here) / ``dlc-v<i>`` (10.235.<i>.2, the node's address), with a route to its pod
  subnet 10.234.<i>.0/24. containerd, kubelet, kube-proxy and CoreDNS run in that namespace, so the
  node's bridge, veths and iptables chains exist only there and go with it;
- a relay on 10.235.<i>.1 to the apiserver on loopback (``diloco_testbed.relay``); pods reach it as
  the ``kubernetes`` Service (the apiserver runs with ``--endpoint-reconciler-type=none`` and the
  node writes that Service's endpoints);
- its own containerd socket, state and root (the root, which holds the imported images, is kept
  between runs in ~/.cache/diloco/node/n<i>), kubelet root folder, folder of pod logs and cgroup
  root ``/diloco-n<i>``.

An instance is taken with an exclusive lock (released by the kernel when the test process dies);
taking it first sweeps whatever a crashed run of that instance left: its processes (found by the
instance's socket path), mounts under its folders, its cgroups, its network namespace and veth.
In tests the node is tainted ``diloco.dev/real-node:NoSchedule`` (the control plane also has kwok
nodes); pods of a namespace made with ``RealNode.namespace_annotations()`` are placed on it (and
only there) by the apiserver's PodNodeSelector and PodTolerationRestriction admission plugins.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import yaml
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from .prereq import require_binary, unavailable
from .process import ManagedProcess, await_started, stop_all

SETUP_HINT = (
    "run scripts/setup-system.sh as root (containerd, runc, CNI plugins, iptables, podman, mmdebstrap)"
)
IMAGES_HINT = "run scripts/build-test-images.sh and set DILOCO_TEST_IMAGES to the file it prints"
CNI_BIN_DIR = Path("/usr/lib/cni")
LOCK_DIR = Path("/run/diloco-node")
CACHE_DIR = Path.home() / ".cache" / "diloco" / "node"
CGROUP_ROOT = Path("/sys/fs/cgroup")
MAX_INSTANCES = 8
TAINT_KEY = "diloco.dev/real-node"
NODE_LABEL = "diloco.dev/real-node"
SERVICE_CIDR = "10.96.0.0/16"
DNS_SERVICE_IP = "10.96.0.10"
START_TIMEOUT = 180.0


@dataclass(frozen=True)
class Instance:
    """The names and addresses of node instance ``index`` (see the module docstring)."""

    index: int

    @property
    def name(self) -> str:
        return f"diloco-n{self.index}"

    @property
    def netns(self) -> str:
        return self.name

    @property
    def host_if(self) -> str:
        return f"dlc-h{self.index}"

    @property
    def node_if(self) -> str:
        return f"dlc-v{self.index}"

    @property
    def bridge(self) -> str:
        return f"dlc-br{self.index}"

    @property
    def host_ip(self) -> str:
        return f"10.235.{self.index}.1"

    @property
    def node_ip(self) -> str:
        return f"10.235.{self.index}.2"

    @property
    def pod_cidr(self) -> str:
        return f"10.234.{self.index}.0/24"

    @property
    def state_dir(self) -> Path:
        """Sockets, containerd's state, the lock: gone at reboot."""
        return LOCK_DIR / f"n{self.index}"

    @property
    def cache_dir(self) -> Path:
        """containerd's root (its images) and the kubelet's folder: kept between runs."""
        return CACHE_DIR / f"n{self.index}"

    @property
    def socket(self) -> Path:
        return self.state_dir / "containerd.sock"

    @property
    def cgroup(self) -> str:
        return f"/{self.name}"


def _run(*argv: str, check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    if not quiet and result.returncode != 0:
        print(f"[node] {' '.join(argv)}: {result.stderr.strip()}")
    return result


def in_netns(inst: Instance, argv: list[str]) -> list[str]:
    """``argv`` run in the node's network namespace (and this machine's mount namespace, which
    containerd and the kubelet must share: the kubelet's volume mounts are bind-mounted into pods)."""
    return ["nsenter", f"--net=/run/netns/{inst.netns}", "--", *argv]


# -- sweeping what an instance left -------------------------------------------------------------


def _mounts_under(roots: list[Path]) -> list[str]:
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        for line in fh:
            point = line.split()[4].encode().decode("unicode_escape")
            if any(point == str(r) or point.startswith(f"{r}/") for r in roots):
                found.append(point)
    return sorted(found, key=lambda p: p.count("/"), reverse=True)


def _processes_mentioning(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids


def _cgroup_dirs(inst: Instance) -> list[Path]:
    dirs = []
    for hierarchy in CGROUP_ROOT.iterdir():
        top = hierarchy / inst.name
        if top.is_dir():
            dirs.extend(
                sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
            )
            dirs.append(top)
    return dirs


def _kill_cgroup_processes(inst: Instance) -> None:
    for _ in range(10):
        pids = set()
        for d in _cgroup_dirs(inst):
            try:
                pids.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except OSError:
                continue
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.3)


def sweep(inst: Instance) -> None:
    """Remove what instance ``inst`` may have left: its processes, the processes of its pods,
    mounts under its folders, its cgroups, its network namespace (with the bridge, veths and
    iptables chains in it) and its veth. Touches nothing that is not the instance's own."""
    for pid in _processes_mentioning(str(inst.state_dir)):  # containerd, its shims, kubelet, ...
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _kill_cgroup_processes(inst)
    for point in _mounts_under([inst.state_dir, inst.cache_dir]):
        _run("umount", "-l", point, check=False, quiet=True)
    for d in _cgroup_dirs(inst):
        with contextlib.suppress(OSError):
            d.rmdir()
    if Path(f"/run/netns/{inst.netns}").exists():
        _run("ip", "netns", "delete", inst.netns, check=False)
    if Path(f"/sys/class/net/{inst.host_if}").exists():
        _run("ip", "link", "delete", inst.host_if, check=False)
    shutil.rmtree(inst.cache_dir / "kubelet", ignore_errors=True)
    shutil.rmtree(inst.cache_dir / "pod-logs", ignore_errors=True)
    for name in ("containerd-state", "cni", "config", "kubelet-pki", "netns"):
        shutil.rmtree(inst.state_dir / name, ignore_errors=True)


def take_instance() -> tuple[Instance, IO[str]]:
    """The first instance whose lock is free, locked (the lock dies with this process), swept."""
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    for index in range(MAX_INSTANCES):
        inst = Instance(index)
        inst.state_dir.mkdir(parents=True, exist_ok=True)
        fh = open(inst.state_dir / "lock", "w")  # noqa: SIM115 - held for the node's lifetime
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            continue
        sweep(inst)
        return inst, fh
    unavailable(f"all {MAX_INSTANCES} real-node instances of this machine are in use")


# The kubelet sets these machine-wide sysctls when it starts (and refuses to start instead with
# protectKernelDefaults); a test node must not leave them changed for everything else on the machine.
KERNEL_TUNABLES = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                   "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")  # fmt: skip


def read_kernel_tunables() -> dict[str, str]:
    out = {}
    for key in KERNEL_TUNABLES:
        try:
            out[key] = (Path("/proc/sys") / key).read_text().strip()
        except OSError:
            continue
    return out


def restore_kernel_tunables(saved: dict[str, str]) -> None:
    for key, value in saved.items():
        path = Path("/proc/sys") / key
        try:
            if path.read_text().strip() != value:
                path.write_text(value)
        except OSError as exc:
            print(f"[node] could not restore {key}={value}: {exc}")


# -- the node -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Image:
    image: str
    archive: Path


def load_image_set(path: str | None) -> dict[str, Image]:
    """The images of scripts/build-test-images.sh: {name: Image} from the JSON file it printed."""
    if not path:
        unavailable(f"DILOCO_TEST_IMAGES is not set: {IMAGES_HINT}")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        unavailable(f"cannot read DILOCO_TEST_IMAGES={path}: {exc}; {IMAGES_HINT}")
    images = {name: Image(str(v["image"]), Path(v["archive"])) for name, v in data.items()}
    missing = [str(i.archive) for i in images.values() if not i.archive.is_file()]
    if missing:
        unavailable(f"image archives are missing: {', '.join(missing)}; {IMAGES_HINT}")
    return images


def kubeconfig_for(server: str, ca_cert: Path, token: str) -> dict[str, Any]:
    """A kubeconfig that reaches the apiserver at ``server`` and checks it by its service name
    (the serving certificate names 127.0.0.1 and kubernetes.default.svc, not the relay address)."""
    ca = base64.b64encode(ca_cert.read_bytes()).decode()
    cluster = {
        "server": server,
        "certificate-authority-data": ca,
        "tls-server-name": "kubernetes.default.svc",
    }
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": cluster}],
        "users": [{"name": "admin", "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin"}}],
        "current-context": "test",
    }


class RealNode:
    """One real node joined to a control plane; ``start()``, then ``close()`` (which sweeps)."""

    def __init__(
        self,
        workdir: Path,
        *,
        apiserver_port: int,
        ca_cert: Path,
        token: str,
        api: k8s.ApiClient,
        images: dict[str, Image],
        taint: bool = True,
    ) -> None:
        self.workdir = workdir
        self.taint = taint  # kept for the pods of namespaces made for it (the tests share a cluster)
        self.apiserver_port = apiserver_port
        self.ca_cert = ca_cert
        self.token = token
        self.api = api
        self.images = images
        self.processes: list[ManagedProcess] = []
        self.inst: Instance | None = None
        self._lock: IO[str] | None = None
        self.binaries = {n: require_binary(n) for n in ("kubelet", "kube-proxy", "coredns")}
        for tool in ("containerd", "ctr", "runc", "iptables", "nsenter", "ip"):
            if shutil.which(tool) is None:
                unavailable(f"{tool!r} not found: {SETUP_HINT}")
        if not (CNI_BIN_DIR / "bridge").is_file():
            unavailable(f"the CNI plugins are missing from {CNI_BIN_DIR}: {SETUP_HINT}")
        if os.geteuid() != 0:
            unavailable("a real node needs root (network namespaces, mounts, cgroups)")

    @property
    def name(self) -> str:
        assert self.inst is not None
        return self.inst.name

    @property
    def conf_dir(self) -> Path:
        """The instance's configuration files: every process of the node names one, which is how a
        later sweep finds them."""
        assert self.inst is not None
        return self.inst.state_dir / "config"

    def start(self) -> None:
        t0 = time.monotonic()
        self.inst, self._lock = take_instance()
        print(f"[node] starting real node {self.inst.name} in {self.workdir} (logs: {self.workdir}/*.log)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._network()
            self._spawn("relay", [sys.executable, "-m", "diloco_testbed.relay", f"--instance={self.inst.state_dir}",
                                  f"{self.inst.host_ip}:{self.apiserver_port}=127.0.0.1:{self.apiserver_port}"],
                        netns=False, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
            self._cgroup_root()
            self._write_kubeconfig()
            self._start_containerd()
            self._import_images()
            self._cluster_services()
            tunables = read_kernel_tunables()
            try:
                self._start_kubelet()
                self._start_kube_proxy()
                self._start_coredns()
                self._await_ready()
            finally:
                restore_kernel_tunables(tunables)
        except BaseException:
            self.close()
            raise
        print(f"[node] {self.inst.name} Ready at {self.inst.node_ip} after {time.monotonic() - t0:.0f}s")

    def close(self) -> None:
        if self.inst is None:
            return
        kubelet = [p for p in self.processes if p.name == "kubelet"]
        stop_all(kubelet)  # no more pods started while the rest goes
        self._remove_containers()
        stop_all([p for p in self.processes if p.name != "kubelet"])
        self.processes.clear()
        sweep(self.inst)
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        self.inst = None

    # -- pieces --------------------------------------------------------------------------------

    def _spawn(
        self, name: str, argv: list[str], *, netns: bool = True, cwd: Path | None = None
    ) -> ManagedProcess:
        assert self.inst is not None
        proc = ManagedProcess(name, in_netns(self.inst, argv) if netns else argv, self.workdir / f"{name}.log",
                              cwd=cwd)  # fmt: skip
        proc.start()
        self.processes.append(proc)
        return proc

    def _network(self) -> None:
        inst = self.inst
        assert inst is not None
        _run("ip", "netns", "add", inst.netns)
        _run(
            "ip",
            "link",
            "add",
            inst.host_if,
            "type",
            "veth",
            "peer",
            "name",
            inst.node_if,
            "netns",
            inst.netns,
        )
        _run("ip", "addr", "add", f"{inst.host_ip}/24", "dev", inst.host_if)
        _run("ip", "link", "set", inst.host_if, "up")
        ns = ("ip", "-n", inst.netns)
        _run(*ns, "link", "set", "lo", "up")
        _run(*ns, "addr", "add", f"{inst.node_ip}/24", "dev", inst.node_if)
        _run(*ns, "link", "set", inst.node_if, "up")
        _run(*ns, "route", "add", "default", "via", inst.host_ip)
        _run("ip", "route", "add", inst.pod_cidr, "via", inst.node_ip, "dev", inst.host_if)
        for key in ("net.ipv4.ip_forward=1", "net.bridge.bridge-nf-call-iptables=1"):
            _run(*in_netns(inst, ["sysctl", "-q", "-w", key]))

    def _cgroup_root(self) -> None:
        """The kubelet's cgroup root (it must exist), in every cgroup v1 hierarchy; a new cpuset
        cgroup gets its parent's CPUs and memory nodes, or no task could join it."""
        assert self.inst is not None
        for hierarchy in CGROUP_ROOT.iterdir():
            if not (hierarchy / "cgroup.procs").exists():
                continue
            top = hierarchy / self.inst.name
            top.mkdir(exist_ok=True)
            for key in ("cpuset.cpus", "cpuset.mems"):
                if (top / key).exists() and not (top / key).read_text().strip():
                    (top / key).write_text((hierarchy / key).read_text())

    def _write_kubeconfig(self) -> None:
        assert self.inst is not None
        server = f"https://{self.inst.host_ip}:{self.apiserver_port}"
        self.kubeconfig = self.conf_dir / "kubeconfig.yaml"
        self.kubeconfig.write_text(yaml.safe_dump(kubeconfig_for(server, self.ca_cert, self.token)))

    def _containerd_config(self) -> Path:
        inst = self.inst
        assert inst is not None
        cni_conf = inst.state_dir / "cni" / "net.d"
        cni_conf.mkdir(parents=True, exist_ok=True)
        (cni_conf / "10-diloco.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0",
            "name": inst.name,
            "plugins": [
                {"type": "bridge", "bridge": inst.bridge, "isGateway": True, "ipMasq": True, "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": inst.pod_cidr}]],
                          "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(inst.state_dir / "cni" / "ipam")}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }))  # fmt: skip
        pause = self.images["pause"].image
        root = inst.cache_dir / "containerd"
        config = f"""version = 2
root = "{root}"
state = "{inst.state_dir / 'containerd-state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.grpc.v1.introspection.tracing"]
[grpc]
  address = "{inst.socket}"
[ttrpc]
  address = "{inst.socket}.ttrpc"
[debug]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{root}/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    discard_unpacked_layers = false
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{shutil.which('runc')}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni_conf}"
"""
        path = self.conf_dir / "containerd.toml"
        path.write_text(config)
        return path

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        assert self.inst is not None
        return _run("ctr", "--address", str(self.inst.socket), "--namespace", "k8s.io", *args, check=check,
                    quiet=not check)  # fmt: skip

    def _start_containerd(self) -> None:
        assert self.inst is not None
        config = self._containerd_config()
        proc = self._spawn("containerd", [shutil.which("containerd") or "containerd", "--config", str(config),
                                          "--log-level", "warn"])  # fmt: skip
        self._await(proc, lambda: self.ctr("version", check=False).returncode == 0, "containerd")

    def _import_images(self) -> None:
        """Import the images this run uses; drop the project's images of other builds (this
        instance's containerd keeps its images between runs, and each build's are a GB or more)."""
        targets = {}  # reference -> digest of its manifest
        for line in self.ctr("images", "list").stdout.splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 3:
                targets[fields[0]] = fields[2]
        present = set(targets)
        wanted = {image.image for image in self.images.values()}
        kept = {digest for ref, digest in targets.items()
                if ref in wanted or not ref.startswith(("diloco.local/", "sha256:"))}  # fmt: skip
        # the CRI also names each image by its ID (sha256:...): that name holds its layers too
        stale = sorted(ref for ref, digest in targets.items()
                       if (ref.startswith("diloco.local/") and ref not in wanted)
                       or (ref.startswith("sha256:") and digest not in kept))  # fmt: skip
        if stale:
            self.ctr("images", "remove", "--sync", *stale, check=False)
        for name, image in sorted(self.images.items()):
            if image.image in present:
                continue
            t0 = time.monotonic()
            self.ctr("images", "import", str(image.archive))
            print(f"[node] imported {name} ({image.image}) in {time.monotonic() - t0:.0f}s")

    def _cluster_services(self) -> None:
        """The ``kubernetes`` Service's endpoint (the relay) and CoreDNS's Service ``kube-dns``."""
        assert self.inst is not None
        core, discovery = k8s.CoreV1Api(self.api), k8s.DiscoveryV1Api(self.api)
        _replace_endpoint_slice(discovery, "default", "kubernetes", "kubernetes", self.inst.host_ip,
                                [("https", self.apiserver_port, "TCP")])  # fmt: skip
        try:
            core.create_namespaced_service("kube-system", {
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "kube-dns", "labels": {"k8s-app": "kube-dns"}},
                "spec": {"clusterIP": DNS_SERVICE_IP, "ports": [
                    {"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]},
            })  # fmt: skip
        except ApiException as exc:
            if exc.status != 409:
                raise
        _replace_endpoint_slice(discovery, "kube-system", "kube-dns", "kube-dns", self.inst.node_ip,
                                [("dns", 53, "UDP"), ("dns-tcp", 53, "TCP")])  # fmt: skip

    def _start_kubelet(self) -> None:
        inst = self.inst
        assert inst is not None
        root = inst.cache_dir / "kubelet"
        root.mkdir(parents=True, exist_ok=True)
        resolv = self.conf_dir / "resolv.conf"
        resolv.write_text(f"nameserver {DNS_SERVICE_IP}\n")
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(self.ca_cert)}},
            "authorization": {"mode": "Webhook"},
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": inst.cgroup,
            "failCgroupV1": False,
            "failSwapOn": False,
            "enforceNodeAllocatable": [],
            "containerRuntimeEndpoint": f"unix://{inst.socket}",
            "clusterDNS": [DNS_SERVICE_IP],
            "clusterDomain": "cluster.local",
            "resolvConf": str(resolv),
            "address": inst.node_ip,
            "healthzBindAddress": inst.node_ip,
            "readOnlyPort": 0,
            "rotateCertificates": False,
            "serializeImagePulls": False,
            "runtimeRequestTimeout": "10m",
            # images and logs on a shared disk: never evict for it, never collect the test images
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "0%", "imagefs.available": "0%",
                             "nodefs.inodesFree": "0%", "imagefs.inodesFree": "0%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "localStorageCapacityIsolation": False,
            "registerWithTaints": [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}] if self.taint else [],
            "nodeStatusReportFrequency": "10s",
            "containerLogMaxSize": "20Mi",
            # the instance's own: a kubelet removes the folders there of pods it does not run, which
            # would be another instance's pods in the machine's /var/log/pods
            "podLogsDir": str(inst.cache_dir / "pod-logs"),
        }  # fmt: skip
        path = self.conf_dir / "kubelet.yaml"
        path.write_text(yaml.safe_dump(config))
        self._spawn("kubelet", [
            str(self.binaries["kubelet"]), f"--config={path}", f"--kubeconfig={self.kubeconfig}",
            f"--root-dir={root}", f"--cert-dir={inst.state_dir / 'kubelet-pki'}",
            f"--hostname-override={inst.name}", f"--node-ip={inst.node_ip}",
            f"--node-labels={NODE_LABEL}=true", "--v=1",
        ])  # fmt: skip

    def _start_kube_proxy(self) -> None:
        inst = self.inst
        assert inst is not None
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self.kubeconfig)},
            "mode": "iptables",
            "clusterCIDR": inst.pod_cidr,
            "hostnameOverride": inst.name,
            "bindAddress": inst.node_ip,
            "healthzBindAddress": f"{inst.node_ip}:10256",
            "metricsBindAddress": f"{inst.node_ip}:10249",
            "iptables": {"masqueradeAll": True},
            # leave this machine's conntrack settings alone
            "conntrack": {
                "maxPerCore": 0,
                "min": 0,
                "tcpEstablishedTimeout": "0s",
                "tcpCloseWaitTimeout": "0s",
            },
        }
        path = self.conf_dir / "kube-proxy.yaml"
        path.write_text(yaml.safe_dump(config))
        self._spawn("kube-proxy", [str(self.binaries["kube-proxy"]), f"--config={path}", "--v=1"])

    def _start_coredns(self) -> None:
        inst = self.inst
        assert inst is not None
        corefile = self.conf_dir / "Corefile"
        corefile.write_text(f""".:53 {{
    bind {inst.node_ip}
    errors
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {self.kubeconfig} test
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
}}
""")
        self._spawn("coredns", [str(self.binaries["coredns"]), "-conf", str(corefile)], cwd=self.workdir)

    def _await(self, proc: ManagedProcess, probe: Any, what: str) -> None:
        await_started(proc, probe, what=what, timeout=START_TIMEOUT, failure="the real node did not start")

    def _await_ready(self) -> None:
        core = k8s.CoreV1Api(self.api)
        kubelet = next(p for p in self.processes if p.name == "kubelet")

        def ready() -> bool:
            for p in self.processes:
                if not p.running():
                    raise RuntimeError(p.failure_report())
            node = core.read_node(self.name)
            return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])

        self._await(kubelet, ready, f"node {self.name} Ready")

    def _remove_containers(self) -> None:
        """Stop every container of the node (the kubelet, stopped, no longer would)."""
        if self.inst is None or not self.inst.socket.exists():
            return
        tasks = self.ctr("tasks", "list", "--quiet", check=False).stdout.split()
        for task in tasks:
            self.ctr("tasks", "kill", "--signal", "SIGKILL", task, check=False)
        deadline = time.monotonic() + 20
        while tasks and time.monotonic() < deadline:
            for task in list(tasks):
                if self.ctr("tasks", "delete", task, check=False).returncode == 0:
                    tasks.remove(task)
            time.sleep(0.3)
        for container in self.ctr("containers", "list", "--quiet", check=False).stdout.split():
            self.ctr("containers", "delete", container, check=False)

    def namespace_annotations(self) -> dict[str, str]:
        """Annotations that put a namespace's pods on this node and let them tolerate its taint."""
        return {
            "scheduler.alpha.kubernetes.io/node-selector": f"{NODE_LABEL}=true",
            "scheduler.alpha.kubernetes.io/defaultTolerations": json.dumps(
                [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]
            ),
        }

    def logs(self) -> Iterator[Path]:
        yield from sorted(self.workdir.glob("*.log"))


def _replace_endpoint_slice(
    discovery: k8s.DiscoveryV1Api, namespace: str, name: str, service: str, address: str,
    ports: list[tuple[str, int, str]],
) -> None:  # fmt: skip
    body = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": service,
                                               "endpointslice.kubernetes.io/managed-by": "diloco-test-node"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
        "ports": [{"name": n, "port": p, "protocol": proto} for n, p, proto in ports],
    }  # fmt: skip
    try:
        discovery.delete_namespaced_endpoint_slice(name, namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
    discovery.create_namespaced_endpoint_slice(namespace, body)
