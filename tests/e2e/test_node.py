"""The real node itself: a pod runs a process, resolves Services by name through CoreDNS and
reaches the apiserver as the `kubernetes` Service with its ServiceAccount token."""

from __future__ import annotations

import pytest
from diloco_testbed.pods import pod_logs, wait_pod_phase
from kubernetes import client as k8s

from tests.e2e.cluster import E2ECluster

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

PROBE = """
import json, socket, ssl, urllib.request
addr = socket.gethostbyname("kubernetes.default.svc.cluster.local")
token = open("/var/run/secrets/kubernetes.io/serviceaccount/token").read()
ctx = ssl.create_default_context(cafile="/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
req = urllib.request.Request("https://kubernetes.default.svc/version", headers={"Authorization": "Bearer " + token})
print(json.dumps({"address": addr, "version": json.load(urllib.request.urlopen(req, context=ctx, timeout=20))["gitVersion"]}))
"""


@pytest.mark.timeout(1200)  # may be the first e2e test: it also starts the node
def test_a_pod_runs_resolves_services_and_reaches_the_apiserver(e2e: E2ECluster, api: k8s.ApiClient) -> None:
    ns = e2e.new_namespace("node")
    core = k8s.CoreV1Api(api)
    core.create_namespaced_pod(ns, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"},
        "spec": {"restartPolicy": "Never", "containers": [{
            "name": "probe", "image": e2e.images["sync"], "imagePullPolicy": "IfNotPresent",
            "command": ["python", "-c", PROBE]}]},
    })  # fmt: skip
    pod = wait_pod_phase(core, ns, "probe", ("Succeeded", "Failed"), timeout=180)
    logs = pod_logs(core, ns, "probe")
    assert pod.status.phase == "Succeeded", logs
    assert '"version": "v1.' in logs, logs
    if e2e.node is not None:
        assert pod.spec.node_name == e2e.node.name
