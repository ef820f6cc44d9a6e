"""A real local Kubernetes cluster without Docker: `make cluster`.

Starts the control plane the tests use (etcd, kube-apiserver, kube-controller-manager, kube-scheduler
on loopback ports) and one real node (containerd, kubelet, kube-proxy, CoreDNS) with the project's
images imported, writes a kubeconfig and prints how to use it; stops everything on Ctrl-C (or
SIGTERM) and leaves nothing behind. Needs root, the packages of scripts/setup-system.sh, the
binaries of scripts/build-test-binaries.sh and the images of scripts/build-test-images.sh (the
Makefile target runs all three).

    python scripts/local-cluster.py --images FILE [--dir DIR]
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from pathlib import Path

from diloco_testbed.kube import ControlPlane
from diloco_testbed.node import RealNode, load_image_set

USAGE = """
A real local cluster is up: one node ({node}), the project's images loaded.

  export KUBECONFIG={kubeconfig}
  kubectl get nodes

Images (pullPolicy IfNotPresent):
  worker        {worker}
  synchronizer  {sync}   (also runs the operator)
  seaweedfs     {seaweedfs}

Install the operator and train: see docs/operator.md ("A real cluster on this machine").
Ctrl-C stops the cluster and removes everything it made.
"""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="make cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", required=True, help="the file printed by scripts/build-test-images.sh")
    parser.add_argument(
        "--dir", default=None, help="where the kubeconfig and logs go (default: a new temporary folder)"
    )
    args = parser.parse_args(argv)
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="diloco-cluster-"))
    images = load_image_set(args.images)
    plane = ControlPlane(workdir / "kube", with_kwok=False)
    plane.start()
    node = None
    try:
        assert plane.pki is not None
        with plane.api_client() as api:
            node = RealNode(workdir / "node", apiserver_port=plane.ports["apiserver"], ca_cert=plane.pki.ca_cert,
                            token=plane.token, api=api, images=images, taint=False)  # fmt: skip
            node.start()
            print(USAGE.format(node=node.name, kubeconfig=plane.kubeconfig, worker=images["worker"].image,
                               sync=images["sync"].image, seaweedfs=images["seaweedfs"].image))  # fmt: skip
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            stop.wait()
            print("stopping the cluster")
            node.close()
    finally:
        if node is not None:
            node.close()
        plane.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
