"""A real local Kubernetes cluster without Docker: `make cluster`.

Starts the control plane the tests use (etcd, kube-apiserver, kube-controller-manager, kube-scheduler
on loopback ports) and one real node (containerd, kubelet, kube-proxy, CoreDNS) with the project's
images imported, writes a kubeconfig and prints how to use it; stops everything on Ctrl-C (or
SIGTERM) and leaves nothing behind. Needs root, the packages of scripts/setup-system.sh, the
binaries of scripts/build-test-binaries.sh and the images of scripts/build-test-images.sh (the
Makefile target runs all three).

With ``--storage NAMESPACE`` it also deploys SeaweedFS in namespace ``storage`` and makes, in each
named namespace, the Secret ``diloco-s3`` and the bucket ``diloco``: the storage
examples/single-region.yaml names.

With ``--kueue`` it also runs Kueue (its CRDs, webhooks and manager, as the tests do), makes a
ResourceFlavor ``default`` and a ClusterQueue ``local`` with the node's CPU and memory as its quota,
and in each ``--storage`` namespace a LocalQueue ``local`` (the namespace labelled for Kueue):
``spec.queueName: local`` then queues a job's units (docs/operator.md, "Running under Kueue").

    python scripts/local-cluster.py --images FILE [--dir DIR] [--storage NAMESPACE[,NAMESPACE...]] [--kueue]
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from pathlib import Path

from diloco_testbed.kube import ControlPlane
from diloco_testbed.kueue import Kueue, local_queues
from diloco_testbed.node import RealNode, load_image_set
from diloco_testbed.storage import BUCKET, ENDPOINT, SECRET, set_up_storage, storage_namespaces

USAGE = """
A real local cluster is up: one node ({node}), the project's images loaded.

  export KUBECONFIG={kubeconfig}
  kubectl get nodes

Images (pullPolicy IfNotPresent):
  worker        {worker}
  synchronizer  {sync}   (also runs the operator)
  seaweedfs     {seaweedfs}
{storage}
Install the operator and train: see docs/operator.md ("A real cluster on this machine").
Ctrl-C stops the cluster and removes everything it made.
"""

STORAGE = """
S3 storage (SeaweedFS, in namespace storage), as examples/single-region.yaml names it:
  endpoint  {endpoint}
  bucket    {bucket}
  Secret    {secret} (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY), in {namespaces}
"""


KUEUE = """
Kueue: {queues}
  a job with spec.queueName: local is admitted unit by unit (kubectl get workloads -A)
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options; ``storage`` is the list of namespaces that get the storage Secret and bucket."""
    parser = argparse.ArgumentParser(prog="make cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", required=True, help="the file printed by scripts/build-test-images.sh")
    parser.add_argument(
        "--dir", default=None, help="where the kubeconfig and logs go (default: a new temporary folder)"
    )
    parser.add_argument(
        "--storage",
        action="append",
        default=[],
        metavar="NAMESPACE[,NAMESPACE...]",
        help=f"deploy SeaweedFS (namespace storage, {ENDPOINT}) and make the Secret {SECRET} and the "
        f"bucket {BUCKET} in these namespaces (made if missing); repeatable",
    )
    parser.add_argument(
        "--kueue",
        action="store_true",
        help="also run Kueue, with a ClusterQueue 'local' (the node's CPU and memory) and a LocalQueue "
        "'local' in each --storage namespace",
    )
    args = parser.parse_args(argv)
    try:
        args.storage = storage_namespaces(args.storage)
    except ValueError as exc:
        parser.error(f"--storage: {exc}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="diloco-cluster-"))
    images = load_image_set(args.images)
    names = {name: image.image for name, image in images.items()}
    plane = ControlPlane(workdir / "kube", with_kwok=False)
    plane.start()
    node = None
    kueue = None
    try:
        assert plane.pki is not None
        with plane.api_client() as api:
            node = RealNode(workdir / "node", apiserver_port=plane.ports["apiserver"], ca_cert=plane.pki.ca_cert,
                            token=plane.token, api=api, images=images, taint=False)  # fmt: skip
            node.start()
            storage = ""
            if args.storage:
                word = "namespaces" if len(args.storage) > 1 else "namespace"
                namespaces = f"{word} {', '.join(args.storage)}"
                print(f"deploying SeaweedFS; the Secret {SECRET} and the bucket {BUCKET} for {namespaces}")
                set_up_storage(api, names, args.storage)
                storage = STORAGE.format(
                    endpoint=ENDPOINT, bucket=BUCKET, secret=SECRET, namespaces=namespaces
                )
            if args.kueue:
                kueue = Kueue(plane, workdir / "kueue")
                kueue.start()
                storage += KUEUE.format(queues=local_queues(api, node.name, args.storage))
            print(USAGE.format(node=node.name, kubeconfig=plane.kubeconfig, worker=names["worker"],
                               sync=names["sync"], seaweedfs=names["seaweedfs"], storage=storage))  # fmt: skip
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            stop.wait()
            print("stopping the cluster")
    finally:
        if kueue is not None:
            kueue.stop()
        if node is not None:
            node.close()
        plane.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
