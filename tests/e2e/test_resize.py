"""A learner unit resized from one pod to two and back, as pods on the real node: its progress is kept
(each size resumes from the newest step the unit checkpointed) and the job's tokens never go down."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_testbed.pods import pod_logs
from diloco_testbed.waiting import wait_for
from kubernetes import client as k8s

from tests.e2e.cluster import E2ECluster
from tests.e2e.stack import SMALL, Synchronizer, printed_columns, tiny_job

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow]

JOB = "resize"
RESUMED_FROM_LEADER = "resumed from the unit leader's checkpoint"


def _manifest(e2e: E2ECluster, replicas: int) -> dict[str, Any]:
    return tiny_job(
        e2e,
        JOB,
        train={"lr": 3e-3, "warmupSteps": 10, "checkpointEvery": 4},
        learnerUnits=[{"name": "solo", "replicas": replicas, "batchSize": 8, "resources": SMALL}],
    )


class Tokens:
    """The job's TOKENS column, sampled while waiting: it must never go down."""

    def __init__(self, e2e: E2ECluster, ns: str) -> None:
        self.e2e, self.ns, self.seen = e2e, ns, [0]

    def sample(self) -> None:
        value = printed_columns(self.e2e, self.ns, JOB).get("TOKENS") or "0"
        self.seen.append(int(value))
        assert self.seen[-1] >= max(self.seen[:-1]), self.seen


def _resumed_step(core: k8s.CoreV1Api, ns: str, pod: str, marker: str, not_uid: str = "") -> int | None:
    """The step the pod's log says it resumed from (None: not yet, or it is still the pod of ``not_uid``)."""
    try:
        if core.read_namespaced_pod(pod, ns).metadata.uid == not_uid:
            return None
    except k8s.ApiException:
        return None
    lines = [ln for ln in pod_logs(core, ns, pod).splitlines() if marker in ln]
    return int(lines[-1].split("step=")[1].split()[0]) if lines else None


@pytest.mark.timeout(1500)
def test_a_unit_resized_from_one_pod_to_two_and_back_keeps_its_progress(
    e2e: E2ECluster, api: k8s.ApiClient, storage_secret: str, jobs_namespace: str, operator: str
) -> None:
    ns, core = jobs_namespace, k8s.CoreV1Api(api)
    custom = k8s.CustomObjectsApi(api)
    custom.create_namespaced_custom_object("diloco.dev", "v1alpha1", ns, "dilocojobs", _manifest(e2e, 1))
    sync, tokens = Synchronizer(api, ns, JOB), Tokens(e2e, ns)
    leader = f"{JOB}-solo-0"

    def step() -> int:
        tokens.sample()
        try:
            return {x["learner_id"]: x["step"] for x in sync.status()["learners"]}.get(leader, 0)
        except Exception:  # the synchronizer's pod between two addresses
            return 0

    def resize(replicas: int) -> None:
        spec = _manifest(e2e, replicas)["spec"]
        custom.patch_namespaced_custom_object("diloco.dev", "v1alpha1", ns, "dilocojobs", JOB,
                                              {"spec": {"learnerUnits": spec["learnerUnits"]}})  # fmt: skip

    try:
        wait_for(lambda: step() >= 12, timeout=600, interval=3, what="one pod trains 12 steps")
        resize(2)
        as_one = step()
        resumed = wait_for(
            lambda: (tokens.sample(), _resumed_step(core, ns, f"{JOB}-solo-1", RESUMED_FROM_LEADER))[1],
            timeout=600, interval=3, what="the second pod resumes from the first pod's checkpoint",
        )  # fmt: skip
        assert resumed >= as_one
        assert _resumed_step(core, ns, leader, RESUMED_FROM_LEADER) == resumed
        wait_for(lambda: step() >= resumed + 8, timeout=600, interval=3, what="two pods train on")

        two_pods_leader = core.read_namespaced_pod(leader, ns).metadata.uid
        resize(1)
        as_two = step()
        back = wait_for(
            lambda: (step(), _resumed_step(core, ns, leader, "resumed from checkpoint", two_pods_leader))[1],
            timeout=600, interval=3, what="one pod again, resumed",
        )  # fmt: skip
        wait_for(lambda: step() > back, timeout=300, interval=3, what="one pod trains on")
        assert back >= as_two  # the steps trained as two pods are kept
        assert not [p for p in core.list_namespaced_pod(ns, label_selector=f"diloco.dev/job={JOB}").items
                    if p.metadata.name == f"{JOB}-solo-1"]  # fmt: skip
    finally:
        custom.delete_namespaced_custom_object("diloco.dev", "v1alpha1", ns, "dilocojobs", JOB)
        wait_for(lambda: not core.list_namespaced_pod(ns, label_selector=f"diloco.dev/job={JOB}").items,
                 timeout=180, what="the job's pods gone")  # fmt: skip
