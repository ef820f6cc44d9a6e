"""The test control plane `diloco bench operator` runs on: its set-up (kwok nodes large enough for
the job, the CRDs), the job it creates, the operator's metrics, and waiting on the cluster."""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from diloco_bench.operator_watch import Watcher

ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "diloco.dev", "v1alpha1", "dilocojobs"
JOB = "scale"


def bench_job(name: str, units: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    """A DiLoCoJob of ``units`` with images and storage that are never reached (on kwok a pod is only
    its object), quorum 1, and ``spec``'s further fields."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "DiLoCoJob",
        "metadata": {"name": name},
        "spec": {
            "images": {
                "worker": "example.invalid/worker:bench",
                "synchronizer": "example.invalid/sync:bench",
            },
            "storage": {"bucket": "diloco-bench"},
            "diloco": {"quorum": 1},
            "synchronizer": {"resources": {"requests": {"cpu": "10m"}}},
            "learnerUnits": units,
            **spec,
        },
    }


def job_manifest(units: int, pods: int) -> dict[str, Any]:
    unit_resources = {"requests": {"cpu": "10m", "memory": "16Mi"}}
    return bench_job(
        JOB, [{"name": f"u{i:03d}", "replicas": pods, "resources": unit_resources} for i in range(units)]
    )


def scrape_children(port: int) -> tuple[float | None, float | None]:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None, None

    def value(action: str) -> float:
        m = re.search(rf'diloco_operator_children_total{{action="{action}"}} ([0-9.e+]+)', text)
        return float(m.group(1)) if m else 0.0

    return value("created"), value("restored")


def wait(probe: Callable[[], bool], timeout: float, what: str, *watchers: Watcher) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            errors = "; ".join(f"{w.restarts} restart(s), last: {w.error!r}" for w in watchers if w.error)
            raise TimeoutError(
                f"timed out after {timeout:.0f}s waiting for {what}" + (f" ({errors})" if errors else "")
            )
        time.sleep(0.2)


@contextmanager
def control_plane(args: argparse.Namespace) -> Iterator[Any]:
    """The test control plane (``diloco_testbed``, installed with the project), with kwok nodes for the
    job."""
    from diloco_testbed import kwok
    from diloco_testbed.kube import ControlPlane

    extra = {}
    if args.controller_manager_qps:
        qps = args.controller_manager_qps
        extra["kube-controller-manager"] = [f"--kube-api-qps={qps}", f"--kube-api-burst={2 * qps}"]
    workdir = Path(tempfile.mkdtemp(prefix="diloco-bench-operator-"))
    plane = ControlPlane(workdir, extra_args=extra)
    plane.start()
    done = False
    try:
        from kubernetes import client as k8s

        with plane.api_client() as api:
            core = k8s.CoreV1Api(api)
            per_node = 500
            for i in range((args.units * args.pods + 20) // per_node + 1):
                node = kwok.FakeNode(
                    f"kwok-bench-{i}", "region-a", "region-a-1", cpu="1000", memory="4Ti", pods=str(per_node)
                )
                core.create_node(kwok.node_manifest(node))
            ext = k8s.ApiextensionsV1Api(api)
            import yaml

            for path in (ROOT / "crds").glob("*.yaml"):
                for doc in yaml.safe_load_all(path.read_text()):
                    ext.create_custom_resource_definition(doc)
            wait(
                lambda: all(
                    any(
                        c.type == "Established" and c.status == "True"
                        for c in (ext.read_custom_resource_definition(n).status.conditions or [])
                    )
                    for n in ("dilocojobs.diloco.dev",)
                ),
                60,
                "the CRD",
            )
        yield plane
        done = True
    finally:
        plane.close()
        if done and not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"[bench] logs kept in {workdir}")
