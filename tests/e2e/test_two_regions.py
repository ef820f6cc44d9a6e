"""Two regions that train together: two clusters on this machine, a thin WAN link between them.

Region A (the tests' cluster) runs the job's synchronizer, serving HTTPS with a certificate made
here, and one learner unit; it exposes the synchronizer to region B through a LoadBalancer Service
that only region B's address may reach. Region B (a second control plane with a real node of its
own, its own operator and SeaweedFS) runs one learner unit whose DiLoCoJob points at region A's
synchronizer (``synchronizer.external``: the URL, the copied job secret, ``jobId``, the CA bundle).
The link carries at most ``RATE`` each way. Shown, in order:

1. the learners of both regions merge into the same global versions (rounds name both);
2. region B's uploads are throttled (its shaper holds packets back; its uploads run at the link's
   rate) while its blocked time stays about 0;
3. with region B cut off, region A trains at its own speed (its step rate over the cut compared
   with the same span before it) and merges on; region B keeps training locally and is reported
   dead;
4. when the link returns, region B rejoins: it applies the versions merged while it was away and
   its contributions are merged again.

The bytes and goodput of each region are printed (``pytest -s``), and docs/multi-region.md walks
through the same steps.
"""

from __future__ import annotations

import base64
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from diloco_testbed.node import RealNode
from diloco_testbed.pki import make_ca
from diloco_testbed.pods import pod_logs
from diloco_testbed.storage import BUCKET, ENDPOINT
from diloco_testbed.waiting import wait_for
from kubernetes import client as k8s

from tests.e2e.cluster import E2ECluster
from tests.e2e.regions import Region, second_region
from tests.e2e.stack import (
    Synchronizer,
    create_ca_config_map,
    create_tls_secret,
    job_status,
    run_tool,
)
from tests.support.wan import Wan

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow]

RATE, RATE_BYTES_S = "2mbit", 2e6 / 8
A_JOB, B_JOB = "ra", "rb"
A_LEARNER, B_LEARNER = f"{A_JOB}-a-0", f"{B_JOB}-b-0"
LB_PORT = 443
CUT_S = 40.0  # longer than the heartbeat timeout below: the synchronizer sees region B go
MODEL = {"nLayer": 2, "nHead": 2, "nEmbd": 64, "blockSize": 64}
DILOCO = {"innerSteps": 8, "fragments": 2, "overlap": 1, "quorum": 1, "codec": "int8",
          "heartbeatTimeoutSeconds": 15}  # fmt: skip
SMALL = {"requests": {"cpu": "100m", "memory": "512Mi"}, "limits": {"cpu": "1", "memory": "2Gi"}}


def job(e2e: E2ECluster, name: str, unit: str, synchronizer: dict[str, Any]) -> dict[str, Any]:
    """A small CPU job: the same model and DiLoCo settings in both regions (the plan must match)."""
    return {
        "apiVersion": "diloco.dev/v1alpha1", "kind": "DiLoCoJob", "metadata": {"name": name},
        "spec": {
            "images": {"worker": e2e.images["worker"], "synchronizer": e2e.images["sync"],
                       "pullPolicy": "IfNotPresent"},
            "model": MODEL, "train": {"lr": 3e-3, "warmupSteps": 10}, "diloco": DILOCO,
            "storage": {"endpoint": ENDPOINT, "bucket": BUCKET,
                        "prefix": f"jobs/{name}", "credentialsSecretRef": {"name": "diloco-s3"}},
            "learnerUnits": [{"name": unit, "replicas": 1, "batchSize": 8, "resources": SMALL}],
            "synchronizer": synchronizer,
            "budget": {"steps": 1_000_000},
        },
    }  # fmt: skip


def apply(e2e: E2ECluster, ns: str, doc: dict[str, Any], tmp: Path) -> Path:
    path = tmp / f"{doc['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    run_tool("kubectl", "apply", "-n", ns, "-f", str(path), env=e2e.kube.env())
    return path


def expose(api: k8s.ApiClient, ns: str, wan: Wan) -> None:
    """Region A's synchronizer, reachable at region A's end of the link, from region B's address
    only: a LoadBalancer Service with ``loadBalancerSourceRanges`` and no node port; its address is
    announced here, as a load balancer controller would (kube-proxy then routes and filters it)."""
    core = k8s.CoreV1Api(api)
    core.create_namespaced_service(ns, {
        "metadata": {"name": f"{A_JOB}-sync-wan"},
        "spec": {
            "type": "LoadBalancer", "allocateLoadBalancerNodePorts": False,
            "loadBalancerSourceRanges": [f"{wan.b.address}/32"],
            "selector": {"diloco.dev/job": A_JOB, "app.kubernetes.io/component": "synchronizer",
                         "diloco.dev/shard": "0"},
            "ports": [{"name": "https", "port": LB_PORT, "targetPort": "https", "protocol": "TCP"}],
        },
    })  # fmt: skip
    core.patch_namespaced_service_status(f"{A_JOB}-sync-wan", ns,
                                         {"status": {"loadBalancer": {"ingress": [{"ip": wan.a.address}]}}})  # fmt: skip


def learners(sync: Synchronizer) -> dict[str, dict[str, Any]]:
    return {lr["learner_id"]: lr for lr in sync.status()["learners"]}


def merged_by(sync: Synchronizer, since: float = 0.0) -> set[str]:
    """The learners whose contributions the rounds finished after ``since`` (epoch seconds) merged."""
    return {p for r in sync.status()["recent_rounds"] if r["finished_at"] > since for p in r["participants"]}


def log_records(text: str, pattern: str) -> list[tuple[float, re.Match[str]]]:
    """(epoch seconds, match) of the worker log lines matching ``pattern`` (its clock is UTC)."""
    out = []
    for line in text.splitlines():
        m = re.search(pattern, line)
        if m is None:
            continue
        stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=UTC)
        out.append((stamp.timestamp(), m))
    return out


def step_rate(records: list[tuple[float, re.Match[str]]], start: float, end: float) -> float:
    """Steps per second between the first progress line at or after ``start`` and the last before ``end``."""
    inside = [(t, int(m["step"])) for t, m in records if start <= t <= end]
    assert len(inside) >= 2, f"too few progress lines between {start} and {end}: {inside}"
    (t0, s0), (t1, s1) = inside[0], inside[-1]
    return (s1 - s0) / (t1 - t0)


def goodput(lr: dict[str, Any]) -> float:
    compute = lr["step"] * lr["step_time_s"]
    return compute / (compute + lr["blocked_s"]) if compute + lr["blocked_s"] > 0 else 0.0


def until(
    what: str, probe: Callable[[], Any], timeout: float = 300, describe: Callable[[], str] | None = None
) -> Any:
    return wait_for(probe, timeout=timeout, what=what, interval=2, describe=describe)


@pytest.mark.timeout(2400)
def test_two_regions_train_together_over_a_thin_link_and_survive_a_cut(
    e2e: E2ECluster, api: k8s.ApiClient, real_node: RealNode | None, storage_secret: str, jobs_namespace: str,
    operator: str, test_logs_dir: Path, tmp_path: Path,
) -> None:  # fmt: skip
    if real_node is None:
        pytest.skip("two regions need the test control plane's real node (a second node instance joins it)")
    t_start = time.monotonic()
    ns_a = jobs_namespace
    with second_region(real_node, test_logs_dir / "region-b", tmp_path / "helm-b", rate=RATE) as (
        region,
        wan,
    ):
        set_up_s = time.monotonic() - t_start
        _train_together(e2e, api, ns_a, region, wan, tmp_path)
    print(
        f"\n[two-regions] region B set up in {set_up_s:.0f}s; the whole test took {time.monotonic() - t_start:.0f}s"
    )


def _train_together(
    e2e: E2ECluster, api: k8s.ApiClient, ns_a: str, region: Region, wan: Wan, tmp: Path
) -> None:
    core_a, core_b = k8s.CoreV1Api(api), k8s.CoreV1Api(region.api)
    ns_b = region.jobs_namespace

    # -- TLS: a CA made here; region A's synchronizer gets a certificate for its Service and for the
    # address region B reaches it at; region B gets the CA certificate alone
    ca = make_ca(tmp / "ca")
    create_tls_secret(
        api, ns_a, f"{A_JOB}-sync-tls", ca, [f"{A_JOB}-sync.{ns_a}.svc", wan.a.address], tmp / "pki"
    )
    create_ca_config_map(region.api, ns_b, f"{A_JOB}-sync-ca", ca)

    # -- region A: the synchronizer (HTTPS) and one learner; exposed to region B's address only
    path_a = apply(e2e, ns_a, job(e2e, A_JOB, "a", {
        "tls": {"secretName": f"{A_JOB}-sync-tls"}, "ca": {"secretName": f"{A_JOB}-sync-tls"},
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}}), tmp)  # fmt: skip
    expose(api, ns_a, wan)
    sync = Synchronizer(api, ns_a, A_JOB, ca=ca.cert)
    until("region A's synchronizer serving HTTPS", lambda: sync.status()["job_id"] == A_JOB)
    until(
        "region B's address reaching the load balancer", lambda: wan.connects(LB_PORT, source=wan.b.address)
    )
    assert not wan.connects(LB_PORT, source=wan.outsider)  # another address of region B's network

    # -- region B: the job secret copied, the job pointed at region A's synchronizer
    secret = base64.b64decode(
        core_a.read_namespaced_secret(f"{A_JOB}-secret", ns_a).data["job-secret"]
    ).decode()
    core_b.create_namespaced_secret(ns_b, {"metadata": {"name": f"{A_JOB}-job-secret"},
                                           "stringData": {"job-secret": secret}})  # fmt: skip
    path_b = apply(region.e2e, ns_b, job(region.e2e, B_JOB, "b", {"external": {
        "url": f"https://{wan.a.address}", "jobId": A_JOB,
        "tokenSecretRef": {"name": f"{A_JOB}-job-secret", "key": "job-secret"}},
        "ca": {"configMapName": f"{A_JOB}-sync-ca"}}), tmp)  # fmt: skip

    # 1. both regions' learners merge into the same global versions
    until(
        "rounds merging the learners of both regions",
        lambda: {A_LEARNER, B_LEARNER} <= merged_by(sync),
        timeout=900,
        describe=lambda: f"{learners(sync)}; region B: {job_status(region.api, ns_b, B_JOB)}",
    )
    b_status = until(
        "region B's operator reading region A's synchronizer over the link",
        lambda: (s := job_status(region.api, ns_b, B_JOB)).get("version") is not None and s,
    )
    print(
        f"\n[two-regions] global version {job_status(api, ns_a, A_JOB).get('version')} in region A's status, "
        f"{b_status['version']} in region B's"
    )

    # 2. region B's uploads are throttled (from its start) and it does not wait for them
    until("region B sending a dozen outer gradients", lambda: _uploads(core_b, ns_b)[0] >= 12, timeout=600)
    b = learners(sync)[B_LEARNER]
    sent, seconds = _uploads(core_b, ns_b)[1:]
    b_rate, a_rate = sent / seconds, _upload_rate(core_a, ns_a)
    shaper = wan.counters()["b"]
    print(
        f"[two-regions] region B uploads at {b_rate * 8 / 1e6:.2f} Mbit/s (link {RATE}; region A's at "
        f"{a_rate * 8 / 1e6:.2f} Mbit/s), its shaper held packets back {shaper.overlimits} times; blocked "
        f"{b['blocked_s']:.2f}s in {b['step']} steps of {b['step_time_s']:.3f}s (goodput {goodput(b):.3f})"
    )
    assert shaper.overlimits > 0, shaper  # the shaper did hold region B's traffic back
    assert b_rate <= 1.5 * RATE_BYTES_S, (b_rate, RATE_BYTES_S)  # its uploads ran at the link's rate
    assert goodput(b) >= 0.95, b  # blocked time about 0

    # 3. region B cut off: region A trains on at its own speed; region B is seen to go
    t_cut = time.time()
    a_at_cut = learners(sync)[A_LEARNER]
    versions_at_cut = sync.versions()
    wan.cut()
    until("region B reported dead", lambda: learners(sync)[B_LEARNER]["state"] == "dead", timeout=120)
    time.sleep(max(0.0, t_cut + CUT_S - time.time()))
    versions_at_restore, a_at_restore = sync.versions(), learners(sync)[A_LEARNER]
    t_restore = time.time()
    wan.restore()
    progress = log_records(pod_logs(core_a, ns_a, A_LEARNER), r"step=(?P<step>\d+) loss=")
    rate_before = step_rate(progress, t_cut - CUT_S, t_cut)
    rate_during = step_rate(progress, t_cut, t_restore)
    a_blocked = a_at_restore["blocked_s"] - a_at_cut["blocked_s"]
    print(
        f"[two-regions] region A: {rate_before:.2f} steps/s before the cut, {rate_during:.2f} during it "
        f"(ratio {rate_during / rate_before:.2f}), blocked {a_blocked:.2f}s of {t_restore - t_cut:.0f}s; "
        f"versions {versions_at_cut} -> {versions_at_restore}"
    )
    assert rate_during >= 0.5 * rate_before, (rate_before, rate_during)
    assert a_blocked <= 0.05 * (t_restore - t_cut), a_blocked
    assert all(versions_at_restore[p] > v for p, v in versions_at_cut.items()), (
        versions_at_cut,
        versions_at_restore,
    )

    # 4. the link back: region B rejoins, takes what was merged meanwhile and is merged again
    until("region B alive again", lambda: learners(sync)[B_LEARNER]["state"] == "training", timeout=180)
    until("region B merged again", lambda: B_LEARNER in merged_by(sync, since=t_restore), timeout=300)
    b_logs = pod_logs(core_b, ns_b, B_LEARNER)
    stepped = [
        int(m["step"]) for t, m in log_records(b_logs, r"step=(?P<step>\d+) loss=") if t_cut < t < t_restore
    ]
    assert len(stepped) >= 2, "region B did not train while it was cut off"
    applied = until("region B applying the versions merged while it was away", lambda: (
        got := _applied_since(core_b, ns_b, t_restore)).keys() == versions_at_restore.keys()
        and all(got[p] >= v for p, v in versions_at_restore.items()) and got, timeout=300)  # fmt: skip
    print(
        f"[two-regions] region B trained from step {stepped[0]} to {stepped[-1]} while cut off; after the cut it "
        f"applied versions {applied} (merged meanwhile: {versions_at_restore})"
    )

    _report(sync, wan, learners(sync))
    run_tool("kubectl", "delete", "-n", ns_b, "-f", str(path_b), "--wait=true", env=region.e2e.kube.env())
    run_tool("kubectl", "delete", "-n", ns_a, "-f", str(path_a), "--wait=true", env=e2e.kube.env())
    core_a.delete_namespaced_service(f"{A_JOB}-sync-wan", ns_a)
    core_a.delete_namespaced_secret(f"{A_JOB}-sync-tls", ns_a)


def _uploads(core: k8s.CoreV1Api, ns: str) -> tuple[int, int, float]:
    """(count, bytes, seconds) of the outer gradients region B's learner has sent."""
    sends = log_records(
        pod_logs(core, ns, B_LEARNER), r"sent (?P<n>\d+) bytes \(\d+ inner steps\) in (?P<s>[\d.]+)s"
    )
    return len(sends), sum(int(m["n"]) for _, m in sends), sum(float(m["s"]) for _, m in sends) or 1e-9


def _upload_rate(core: k8s.CoreV1Api, ns: str) -> float:
    sends = log_records(
        pod_logs(core, ns, A_LEARNER), r"sent (?P<n>\d+) bytes \(\d+ inner steps\) in (?P<s>[\d.]+)s"
    )
    return sum(int(m["n"]) for _, m in sends) / (sum(float(m["s"]) for _, m in sends) or 1e-9)


def _applied_since(core: k8s.CoreV1Api, ns: str, since: float) -> dict[int, int]:
    """The newest global version of each fragment region B's learner applied after ``since``."""
    out: dict[int, int] = {}
    for t, m in log_records(pod_logs(core, ns, B_LEARNER), r"fragment=(?P<p>\d+) version=(?P<v>\d+) applied"):
        if t > since:
            out[int(m["p"])] = max(out.get(int(m["p"]), -1), int(m["v"]))
    return out


def _report(sync: Synchronizer, wan: Wan, now: dict[str, dict[str, Any]]) -> None:
    """Bytes and goodput of each region, as the synchronizer and the link count them."""
    status, link = sync.status(), wan.counters()
    a, b = now[A_LEARNER], now[B_LEARNER]
    print(
        f"[two-regions] bytes: region A's learner sent {a['bytes_sent']:,} B of outer gradients; region B's sent "
        f"{b['bytes_sent']:,} B; the link carried {link['b'].sent_bytes:,} B from B to A and "
        f"{link['a'].sent_bytes:,} B from A to B (every byte between the regions); the synchronizer received "
        f"{status['bytes_in']:,} B and sent {status['bytes_out']:,} B in all"
    )
    print(
        f"[two-regions] goodput: region A {goodput(a):.3f} ({a['step']} steps, {a['tokens']:,} tokens), region B "
        f"{goodput(b):.3f} ({b['step']} steps, {b['tokens']:,} tokens); the job {status.get('goodput')}"
    )
