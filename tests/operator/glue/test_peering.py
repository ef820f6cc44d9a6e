"""Two replicas of ``diloco operator`` in kopf peering mode (not ``--standalone``), as processes.

The one with the higher priority does all the work and the other pauses (its liveness says so and
stays 200); once the active one stops, the other takes over and repairs drift on its own.
"""

from __future__ import annotations

import re
import secrets
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from diloco_testbed.kube import Cluster
from diloco_testbed.process import ManagedProcess
from diloco_testbed.waiting import wait_for
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from tests.charts.helm import render
from tests.operator.kubejobs import (
    GROUP,
    PLURAL,
    VERSION,
    children,
    create_job,
    events,
    expected_children,
    job_manifest,
    operator_process,
    phase_is,
    unit,
)

pytestmark = [pytest.mark.integration, pytest.mark.kwok]

PEERINGS = ("kopf.dev", "v1", "clusterkopfpeerings")
# The operator's own lines about a child it wrote.
ACTED = re.compile(
    r"(?:created|restored|deleted) (?:Secret|ConfigMap|Service|Deployment|StatefulSet|PodDisruptionBudget) "
)


@pytest.fixture
def peering(api: k8s.ApiClient) -> Iterator[str]:
    """A ClusterKopfPeering of its own (operator/peering.yaml's kind), removed afterwards."""
    name = f"diloco-operator-{secrets.token_hex(4)}"
    custom = k8s.CustomObjectsApi(api)
    custom.create_cluster_custom_object(
        *PEERINGS, {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}}
    )
    try:
        yield name
    finally:
        try:
            custom.delete_cluster_custom_object(*PEERINGS, name)
        except ApiException as exc:
            if exc.status != 404:
                raise


def replica(kube: Cluster, logs: Path, peering: str, priority: int) -> tuple[ManagedProcess, int]:
    return started_operator(
        kube,
        logs / "operator-peering" / f"{peering}-{priority}.log",
        [f"--peering={peering}", f"--priority={priority}"],
    )


def started_operator(kube: Cluster, log: Path, args: list[str]) -> tuple[ManagedProcess, int]:
    """``diloco operator ARGS`` started against ``kube`` (its own liveness port, no metrics)."""
    proc, live_port = operator_process(log.stem, kube.kubeconfig, args, log)
    proc.start()
    return proc, live_port


def peers(api: k8s.ApiClient, name: str) -> dict[str, Any]:
    return dict(k8s.CustomObjectsApi(api).get_cluster_custom_object(*PEERINGS, name).get("status") or {})


def liveness(port: int) -> tuple[int, Any]:
    resp = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    return resp.status_code, resp.json().get("api") if resp.status_code == 200 else resp.text


def test_only_the_highest_priority_replica_acts_and_the_other_takes_over(
    kube: Cluster,
    api: k8s.ApiClient,
    namespace: str,
    peering: str,
    test_logs_dir: Path,
) -> None:
    high, high_port = replica(kube, test_logs_dir, peering, 100)
    low: ManagedProcess | None = None
    try:
        wait_for(
            lambda: any(p.get("priority") == 100 for p in peers(api, peering).values()),
            timeout=60,
            what="the first replica in the peering",
            describe=high.log_tail,
        )
        low, low_port = replica(kube, test_logs_dir, peering, 50)
        # kopf starts a replica paused until its peering says it may act; this one never may.
        wait_for(
            lambda: any(p.get("priority") == 50 for p in peers(api, peering).values()),
            timeout=60,
            what="the second replica in the peering",
            describe=low.log_tail,
        )
        create_job(api, namespace, job_manifest("peer", [unit("a", 2), unit("b")]))
        wait_for(
            lambda: children(api, namespace, "peer") == expected_children("peer", ["a", "b"]),
            timeout=90,
            what="all children",
            describe=high.log_tail,
        )
        wait_for(
            lambda: phase_is(api, namespace, "peer", "Running", "2/2"),
            timeout=90,
            what="phase Running",
            describe=high.log_tail,
        )
        wait_for(lambda: "Running" in events(api, namespace, "peer"), timeout=30, what="the Running event")
        # Both are live: the paused one says why, and a healthy idle watch is not taken for a dead one.
        assert liveness(high_port) == (200, "ok")
        assert wait_for(lambda: liveness(low_port), timeout=30, what="the paused replica's liveness") == (
            200,
            "paused",
        )

        high_log = high.log_path.read_text(errors="replace")
        low_log = low.log_path.read_text(errors="replace")
        assert "Resuming operations" in high_log
        assert "Resuming operations" not in low_log, low.log_tail(60)
        assert "created StatefulSet peer-a" in high_log
        assert ACTED.findall(low_log) == [], low.log_tail(60)
        twice = [reason for reason, n in Counter(events(api, namespace, "peer")).items() if n > 1]
        assert twice == [], events(api, namespace, "peer")

        high.stop()  # a graceful exit takes it out of the peering: the other resumes
        wait_for(
            lambda: "Resuming operations" in low.log_path.read_text(errors="replace"),
            timeout=90,
            what="the low-priority replica resumed",
            describe=low.log_tail,
        )
        k8s.CoreV1Api(api).delete_namespaced_service("peer-a", namespace)
        wait_for(
            lambda: k8s.CoreV1Api(api).read_namespaced_service("peer-a", namespace),
            timeout=60,
            what="the deleted Service recreated by the remaining replica",
            describe=low.log_tail,
        )
        assert "Service peer-a" in low.log_path.read_text(errors="replace")
        wait_for(
            lambda: liveness(low_port) == (200, "ok"),
            timeout=30,
            what="the remaining replica live, not paused",
        )
        assert low.running(), low.failure_report()
        # Deleted while a replica runs to take its finalizer off: the namespace then goes cleanly.
        custom = k8s.CustomObjectsApi(api)
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "peer")
        wait_for(
            lambda: not custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"],
            timeout=60,
            what="the job deleted",
            describe=low.log_tail,
        )
    finally:
        for proc in (low, high):
            if proc is not None:
                proc.stop()


def test_an_operator_run_by_hand_and_the_charts_pause_for_each_other(
    kube: Cluster,
    api: k8s.ApiClient,
    namespace: str,
    test_logs_dir: Path,
    tmp_path: Path,
) -> None:
    """The chart's operator (its Deployment's arguments) and one started by hand with no peering flag
    join the same peering, which the first one creates: the one of higher priority works, the other
    pauses and says so, and takes over when it stops."""
    custom = k8s.CustomObjectsApi(api)
    try:
        custom.delete_cluster_custom_object(*PEERINGS, "diloco")
    except ApiException as exc:
        if exc.status != 404:
            raise
    (deployment,) = [m for m in render(tmp_path) if m["kind"] == "Deployment"]
    chart_args = [
        a
        for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        if not a.startswith("--liveness=")
    ]
    assert "--peering=diloco" in chart_args
    logs = test_logs_dir / "operator-peering"
    chart, _ = started_operator(kube, logs / f"chart-{namespace}.log", chart_args)
    by_hand: ManagedProcess | None = None
    try:
        wait_for(
            lambda: any(p.get("priority") == 0 for p in peers(api, "diloco").values()),
            timeout=60,
            what="the chart's operator in the peering it created",
            describe=chart.log_tail,
        )
        log = chart.log_path.read_text(errors="replace")
        assert "created the peering object ClusterKopfPeering 'diloco'" in log
        assert "peering: this operator joins ClusterKopfPeering 'diloco' with priority 0" in log
        create_job(api, namespace, job_manifest("hand", [unit("a")]))
        wait_for(
            lambda: phase_is(api, namespace, "hand", "Running", "1/1"),
            timeout=90,
            what="phase Running",
            describe=chart.log_tail,
        )

        by_hand, _ = started_operator(
            kube, logs / f"by-hand-{namespace}.log", ["--priority=10"]
        )  # no --peering
        wait_for(
            lambda: "Pausing operations" in chart.log_path.read_text(errors="replace"),
            timeout=90,
            what="the chart's operator paused for the one run by hand",
            describe=chart.log_tail,
        )
        hand_log = by_hand.log_path.read_text(errors="replace")
        assert "peering: this operator joins ClusterKopfPeering 'diloco' with priority 10" in hand_log
        k8s.CoreV1Api(api).delete_namespaced_service("hand-a", namespace)
        wait_for(
            lambda: "restored Service hand-a" in by_hand.log_path.read_text(errors="replace")
            or "created Service hand-a" in by_hand.log_path.read_text(errors="replace"),
            timeout=60,
            what="the operator run by hand at work",
            describe=by_hand.log_tail,
        )
        assert (
            "Service hand-a" not in chart.log_path.read_text(errors="replace").split("Pausing operations")[-1]
        )

        by_hand.stop()  # it leaves the peering: the chart's operator resumes
        wait_for(
            lambda: "Resuming operations"
            in chart.log_path.read_text(errors="replace").split("Pausing operations")[-1],
            timeout=90,
            what="the chart's operator resumed",
            describe=chart.log_tail,
        )
    finally:
        for proc in (by_hand, chart):
            if proc is not None:
                proc.stop()
