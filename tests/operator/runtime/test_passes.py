"""Passes over a job against the real control plane: the status follows the pods and never goes
back, deleting a job never waits for the operator, and a suspended job raises no warning."""

from __future__ import annotations

import subprocess
import threading
import time
from typing import Any

import pytest
from diloco_testbed.kube import Cluster
from diloco_testbed.waiting import wait_for
from kopf.testing import KopfRunner
from kubernetes import client as k8s
from kubernetes import watch

from tests.operator.kubejobs import (
    GROUP,
    PLURAL,
    VERSION,
    children,
    create_job,
    expected_children,
    get_job,
    job_manifest,
    learner_pods,
    patch_spec,
    phase_is,
    running_on_kwok,
    start_operator,
    unit,
)

pytestmark = [pytest.mark.integration, pytest.mark.kwok]


class StatusRecorder:
    """Every ``readyUnits`` the job's status showed, in the order the watch delivered them."""

    def __init__(self, api: k8s.ApiClient, ns: str, name: str) -> None:
        self.ready: list[int] = []
        self.error: Exception | None = None
        self._watch = watch.Watch()
        self._args = (api, ns, name)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        api, ns, name = self._args
        custom = k8s.CustomObjectsApi(api)
        try:
            for ev in self._watch.stream(
                custom.list_namespaced_custom_object,
                GROUP,
                VERSION,
                ns,
                PLURAL,
                field_selector=f"metadata.name={name}",
                timeout_seconds=600,
            ):
                ready = (ev["object"].get("status") or {}).get("readyUnits")
                if ready is not None and (not self.ready or self.ready[-1] != ready):
                    self.ready.append(int(ready))
        except Exception as exc:  # the stream closed under it: kept for the report
            self.error = exc

    def __enter__(self) -> StatusRecorder:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._watch.stop()


def test_status_counts_units_up_and_never_back_while_a_job_is_created(
    api: k8s.ApiClient, namespace: str, operator: KopfRunner
) -> None:
    """Units only become ready while a job is created: its ready count may only grow. A pass that
    read the world earlier must never write after one that read it later."""
    units = [unit(f"u{i:02d}", 2) for i in range(40)]
    with StatusRecorder(api, namespace, "grow") as seen:
        create_job(api, namespace, job_manifest("grow", units, diloco={"quorum": 20}))
        wait_for(
            lambda: phase_is(api, namespace, "grow", "Running", "40/40"),
            timeout=300,
            interval=1.0,
            what="40/40 units ready",
            describe=lambda: f"{(get_job(api, namespace, 'grow').get('status') or {}).get('unitsReady')}",
        )
        wait_for(lambda: seen.ready and seen.ready[-1] == 40, timeout=30, what="the watch to deliver 40")
    assert seen.error is None
    backwards = [(a, b) for a, b in zip(seen.ready, seen.ready[1:], strict=False) if b < a]
    assert backwards == [], f"the ready count went back: {seen.ready}"
    assert len(seen.ready) > 2  # it moved as the pods came up, not once at the end


def test_a_suspended_job_raises_no_warning(api: k8s.ApiClient, namespace: str, operator: KopfRunner) -> None:
    create_job(api, namespace, job_manifest("rest", [unit("a", 2), unit("b")], diloco={"quorum": 2}))
    wait_for(lambda: phase_is(api, namespace, "rest", "Running", "2/2"), timeout=90, what="phase Running")
    patch_spec(api, namespace, "rest", {"suspend": True})
    wait_for(
        lambda: phase_is(api, namespace, "rest", "Suspended", "0/2"),
        timeout=60,
        what="Suspended, 0/2",
        describe=lambda: str(get_job(api, namespace, "rest").get("status")),
    )
    wait_for(lambda: not learner_pods(api, namespace, "rest"), timeout=60, what="learner pods gone")

    def reasons() -> dict[str, tuple[str, str]]:
        conditions = get_job(api, namespace, "rest")["status"]["conditions"]
        return {c["type"]: (c["status"], c["reason"]) for c in conditions}

    down_on_purpose = ("False", "JobSuspended")
    wait_for(
        lambda: all(
            reasons()[c] == down_on_purpose for c in ("QuorumMet", "LearnersAlive", "SynchronizerReady")
        ),
        timeout=60,
        what="the conditions of the units and synchronizer scaled down to say JobSuspended",
        describe=lambda: str(reasons()),
    )
    events = (
        k8s.CoreV1Api(api).list_namespaced_event(namespace, field_selector="involvedObject.name=rest").items
    )
    assert [(e.type, e.reason) for e in events if e.type == "Warning"] == []
    assert "Suspended" in [e.reason for e in events]


def kubectl(kube: Cluster, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    assert kube.bin_dir is not None
    return subprocess.run(
        [str(kube.bin_dir / "kubectl"), *args],
        capture_output=True,
        text=True,
        env=kube.env(),
        timeout=timeout,
        check=False,
    )


def test_kubectl_delete_does_not_wait_for_the_operator(
    kube: Cluster, api: k8s.ApiClient, namespace: str
) -> None:
    """No finalizer on the job: with the operator stopped, ``kubectl delete`` returns and the garbage
    collector removes the children (owner references)."""
    with start_operator() as runner:
        create_job(api, namespace, job_manifest("bye", [unit("a")]))
        wait_for(
            lambda: children(api, namespace, "bye") == expected_children("bye", ["a"]),
            timeout=90,
            what="children",
        )
        wait_for(
            lambda: running_on_kwok(learner_pods(api, namespace, "bye"), 1), timeout=90, what="pod Running"
        )
    assert runner.exception is None
    assert not get_job(api, namespace, "bye")["metadata"].get("finalizers")
    done = kubectl(kube, "delete", "dilocojob", "bye", "-n", namespace, "--timeout=30s")
    assert done.returncode == 0, done.stderr
    empty = {k: [] for k in expected_children("bye", [])}
    wait_for(
        lambda: children(api, namespace, "bye") == empty,
        timeout=90,
        what="garbage collection",
        describe=lambda: str(children(api, namespace, "bye")),
    )


def test_the_finalizer_of_an_earlier_operator_is_removed(
    api: k8s.ApiClient, namespace: str, operator: KopfRunner
) -> None:
    manifest: dict[str, Any] = job_manifest("old", [unit("a")])
    manifest["metadata"]["finalizers"] = ["diloco.dev/operator", "example.com/keep"]
    create_job(api, namespace, manifest)
    wait_for(
        lambda: get_job(api, namespace, "old")["metadata"].get("finalizers") == ["example.com/keep"],
        timeout=60,
        what="the earlier operator's finalizer removed, another one kept",
    )
    wait_for(lambda: phase_is(api, namespace, "old", "Running"), timeout=90, what="phase Running")
    k8s.CustomObjectsApi(api).patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "old", {"metadata": {"finalizers": None}}
    )


def test_a_spec_that_makes_an_invalid_pod_fails_once_and_creates_nothing(
    api: k8s.ApiClient, namespace: str, operator: KopfRunner
) -> None:
    """What the CRD's schema cannot check (a toleration's operator, free-form there) the apiserver
    refuses in the operator's dry run: one condition, one event, no child, no flood."""
    bad = unit("a", tolerations=[{"key": "dedicated", "operator": "Sometimes", "value": "ml"}])
    create_job(api, namespace, job_manifest("half", [bad, unit("b")]))

    def spec_valid() -> dict[str, Any]:
        status = get_job(api, namespace, "half").get("status") or {}
        return next((c for c in status.get("conditions") or [] if c["type"] == "SpecValid"), {})

    cond = wait_for(
        lambda: (c := spec_valid()).get("status") == "False" and c,
        timeout=60,
        what="SpecValid False",
        describe=lambda: str(get_job(api, namespace, "half").get("status")),
    )
    assert cond["reason"] == "InvalidSpec"
    assert "StatefulSet half-a" in cond["message"]
    assert 'Unsupported value: "Sometimes"' in cond["message"]
    status = get_job(api, namespace, "half")["status"]
    assert status["phase"] == "Failed"
    assert status["message"] == cond["message"]
    time.sleep(5)  # two resync periods
    items = (
        k8s.CoreV1Api(api).list_namespaced_event(namespace, field_selector="involvedObject.name=half").items
    )
    assert [(e.type, e.reason, e.message) for e in items] == [("Warning", "InvalidSpec", cond["message"])]
    assert children(api, namespace, "half") == {k: [] for k in expected_children("half", [])}
    # Fixed: the job starts from scratch.
    patch_spec(
        api,
        namespace,
        "half",
        {
            "learnerUnits": [
                unit("a", tolerations=[{"key": "dedicated", "operator": "Equal", "value": "ml"}]),
                unit("b"),
            ]
        },
    )
    wait_for(
        lambda: phase_is(api, namespace, "half", "Running", "2/2"),
        timeout=90,
        what="Running once fixed",
        describe=lambda: str(get_job(api, namespace, "half").get("status")),
    )
    assert get_job(api, namespace, "half")["status"].get("message") is None
