"""A learner pod's traffic as the real node counts it, next to what the learner reports.

A one-pod job at the job's default codecs trains on the real node. Over a window of its training,
the bytes its pod sent to and received from the synchronizer's port are counted by rules in the
pod's own network namespace (IP packets, headers and retransmissions included), with its traffic
to the object store (checkpoints) and the pod's interface counters (everything) beside them. The
learner's own figures (bytes at the socket, in its heartbeats, shown in the synchronizer's status)
must be the TCP payload the node counted, each way.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import pytest
from diloco_testbed.pod_network import Counts, count_port, interface_counts, pod_pid, port_counts, tcp_payload
from diloco_testbed.storage import S3_PORT
from diloco_testbed.waiting import wait_for
from kubernetes import client as k8s

from tests.e2e.cluster import E2ECluster
from tests.e2e.stack import SMALL, Synchronizer, tiny_job

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow]

JOB = "bytes"
LEARNER = f"{JOB}-solo-0"
WINDOW_S = 60


def _manifest(e2e: E2ECluster) -> dict[str, Any]:
    return tiny_job(
        e2e, JOB, learnerUnits=[{"name": "solo", "replicas": 1, "batchSize": 8, "resources": SMALL}]
    )


def _reported(sync: Synchronizer) -> tuple[int, int]:
    """The learner's bytes at the socket (sent, received), as its newest heartbeat said."""
    for lr in sync.status()["learners"]:
        if lr["learner_id"] == LEARNER:
            return int(lr["wire_sent"]), int(lr["wire_received"])
    return 0, 0


class Sample(NamedTuple):
    reported: tuple[int, int]  # the learner's bytes at the socket (sent, received)
    sync: Counts  # the node's count of the pod's packets to and from the synchronizer's ports
    storage: Counts  # ... and the object store's
    interface: tuple[Counts, Counts]  # the pod's eth0, read just before the rules and just after


def _sample(sync: Synchronizer, pid: int, sync_ports: set[int]) -> Sample:
    """The learner's report and the node's counts, taken together: the counts are read as soon as a
    new heartbeat shows in the status (its figures are the learner's as it sent it). Reading the rules
    takes a few processes' time, so the interface is read on both sides of it: a window from the
    first reading of one sample to the second of the next holds every packet the rules counted."""
    before = _reported(sync)
    reported = wait_for(lambda: (r := _reported(sync)) != before and r, timeout=60, interval=0.1,
                        what="a new heartbeat of the learner")  # fmt: skip
    interface = interface_counts(pid)
    ports, storage = port_counts(pid, sync_ports), port_counts(pid, [S3_PORT])
    return Sample(reported, ports, storage, (interface, interface_counts(pid)))


@pytest.mark.timeout(1200)
def test_a_learner_pods_bytes_at_the_node_are_what_the_learner_reports(
    e2e: E2ECluster, api: k8s.ApiClient, storage_secret: str, jobs_namespace: str, operator: str
) -> None:
    if e2e.node is None:
        pytest.skip("a pod's counters are read on the machine that runs it: needs this machine's real node")
    ns, core = jobs_namespace, k8s.CoreV1Api(api)
    custom = k8s.CustomObjectsApi(api)
    custom.create_namespaced_custom_object("diloco.dev", "v1alpha1", ns, "dilocojobs", _manifest(e2e))
    try:
        sync = Synchronizer(api, ns, JOB)
        wait_for(lambda: _reported(sync)[1] > 0 and (sync.status().get("rounds") or 0) >= 1, timeout=600,
                 interval=3, what="the learner trains and a round is merged")  # fmt: skip
        pid = pod_pid(core.read_namespaced_pod(LEARNER, ns).metadata.uid)
        service = core.read_namespaced_service(f"{JOB}-sync", ns)
        ports = {p.port for p in service.spec.ports} | {
            p.target_port for p in service.spec.ports if isinstance(p.target_port, int)
        }
        for port in sorted(ports | {S3_PORT}):
            count_port(pid, port)
        first = _sample(sync, pid, ports)
        time.sleep(WINDOW_S)
        last = _sample(sync, pid, ports)
    finally:
        custom.delete_namespaced_custom_object("diloco.dev", "v1alpha1", ns, "dilocojobs", JOB)
        wait_for(lambda: not core.list_namespaced_pod(ns, label_selector=f"diloco.dev/job={JOB}").items,
                 timeout=180, interval=2, what="the job's pods gone")  # fmt: skip
    rep_sent, rep_received = last.reported[0] - first.reported[0], last.reported[1] - first.reported[1]
    ports_seen, storage, interface = (
        last.sync - first.sync,
        last.storage - first.storage,
        last.interface[1] - first.interface[0],
    )
    tcp_sent, tcp_received = tcp_payload(ports_seen)
    print(
        f"\n[pod bytes] {WINDOW_S} s of {LEARNER}: reported at the socket sent {rep_sent:,} received "
        f"{rep_received:,}; the node's count to/from the synchronizer port {ports_seen.sent_bytes:,} B in "
        f"{ports_seen.sent_packets:,} packets / {ports_seen.received_bytes:,} B in "
        f"{ports_seen.received_packets:,} packets (TCP payload {tcp_sent:,} / {tcp_received:,}); to/from the object store "
        f"{storage.sent_bytes:,} / {storage.received_bytes:,} B; the pod's eth0 {interface.sent_bytes:,} / "
        f"{interface.received_bytes:,} B"
    )
    assert rep_sent > 0, (first, last)
    assert rep_received > 0, (first, last)
    # a heartbeat's figures are the learner's when it built it: a request on its way then (the one
    # carrying it, a download) lies inside one window and outside the other, at either end
    for reported, payload in ((rep_sent, tcp_sent), (rep_received, tcp_received)):
        assert abs(payload - reported) <= 0.03 * reported + 65_536, (reported, payload, ports_seen)
    assert interface.sent_bytes >= ports_seen.sent_bytes + storage.sent_bytes, (
        interface,
        ports_seen,
        storage,
    )
    assert interface.received_bytes >= ports_seen.received_bytes + storage.received_bytes, (
        interface,
        ports_seen,
    )
