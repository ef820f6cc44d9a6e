"""The operator (kopf, in-process KopfRunner) against a real apiserver, controller-manager, scheduler and kwok."""

from __future__ import annotations

import sys
import time
from typing import Any

import httpx
import pytest
from diloco_operator.builders.learners import TERMINATION_GRACE_SECONDS
from diloco_operator.kube import Kube, api_error
from diloco_operator.runtime.passes import post_events
from diloco_operator.status.events import Event
from diloco_testbed.kwok import FAIL_LABEL
from diloco_testbed.ports import free_port
from diloco_testbed.waiting import wait_for
from kopf.testing import KopfRunner
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from tests.operator.kubejobs import (
    GROUP,
    PLURAL,
    VERSION,
    PodDeletions,
    children,
    create_job,
    events,
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
from tests.operator.schema.test_crd import example_docs, schema

pytestmark = [pytest.mark.integration, pytest.mark.kwok]


def test_job_creates_children_pods_run_and_status_fills(
    api: k8s.ApiClient, namespace: str, operator: KopfRunner
) -> None:
    create_job(api, namespace, job_manifest("alpha", [unit("a", 2), unit("b", 1, region="region-b")]))
    wait_for(
        lambda: children(api, namespace, "alpha") == expected_children("alpha", ["a", "b"]),
        timeout=60,
        what="all children",
        describe=lambda: str(children(api, namespace, "alpha")),
    )
    wait_for(
        lambda: running_on_kwok(learner_pods(api, namespace, "alpha"), 3),
        timeout=90,
        what="3 learner pods Running",
    )
    wait_for(
        lambda: phase_is(api, namespace, "alpha", "Running", "2/2"),
        timeout=60,
        what="phase Running",
        describe=lambda: str(get_job(api, namespace, "alpha").get("status")),
    )
    (b_pod,) = learner_pods(api, namespace, "alpha", "b")
    node = k8s.CoreV1Api(api).read_node(b_pod.spec.node_name)
    assert node.metadata.labels["topology.kubernetes.io/region"] == "region-b"
    status = get_job(api, namespace, "alpha")["status"]
    assert {c["type"]: c["status"] for c in status["conditions"]}["SpecValid"] == "True"
    assert [(u["name"], u["readyReplicas"]) for u in status["units"]] == [("a", 2), ("b", 1)]
    sts = k8s.AppsV1Api(api).read_namespaced_stateful_set("alpha-a", namespace)
    assert sts.metadata.owner_references[0].kind == "DiLoCoJob"
    env = {e.name: e for e in sts.spec.template.spec.containers[0].env}
    assert env["DILOCO_LEARNER_ID"].value_from.field_ref.field_path == "metadata.name"


def test_drift_is_repaired(api: k8s.ApiClient, namespace: str, operator: KopfRunner) -> None:
    create_job(api, namespace, job_manifest("drift", [unit("a", 1)]))
    wait_for(lambda: phase_is(api, namespace, "drift", "Running"), timeout=90, what="phase Running")
    secret_before = k8s.CoreV1Api(api).read_namespaced_secret("drift-secret", namespace).data
    k8s.CoreV1Api(api).delete_namespaced_service("drift-a", namespace)
    k8s.AppsV1Api(api).patch_namespaced_stateful_set("drift-a", namespace, {"spec": {"replicas": 4}})
    k8s.CoreV1Api(api).patch_namespaced_config_map("drift-config", namespace, {"data": {"job.json": "{}"}})

    def repaired() -> bool:
        sts = k8s.AppsV1Api(api).read_namespaced_stateful_set("drift-a", namespace)
        cm = k8s.CoreV1Api(api).read_namespaced_config_map("drift-config", namespace)
        k8s.CoreV1Api(api).read_namespaced_service("drift-a", namespace)
        return sts.spec.replicas == 1 and cm.data["job.json"] != "{}"

    wait_for(repaired, timeout=30, what="hand edits undone and the deleted Service recreated")
    assert k8s.CoreV1Api(api).read_namespaced_secret("drift-secret", namespace).data == secret_before


def test_failed_learner_pod_is_replaced_and_job_keeps_running(
    api: k8s.ApiClient, namespace: str, operator: KopfRunner
) -> None:
    create_job(api, namespace, job_manifest("heal", [unit("a", 2), unit("b", 1)]))
    wait_for(lambda: phase_is(api, namespace, "heal", "Running", "2/2"), timeout=90, what="phase Running")
    victim = learner_pods(api, namespace, "heal", "a")[0]
    k8s.CoreV1Api(api).patch_namespaced_pod(
        victim.metadata.name, namespace, {"metadata": {"labels": {FAIL_LABEL: "true"}}}
    )

    def replaced() -> bool:
        pods = learner_pods(api, namespace, "heal", "a")
        return running_on_kwok(pods, 2) and victim.metadata.uid not in {p.metadata.uid for p in pods}

    wait_for(replaced, timeout=60, what="the failed pod replaced by its StatefulSet")
    wait_for(
        lambda: {"UnitLost", "UnitRejoined"} <= set(events(api, namespace, "heal")),
        timeout=30,
        what="UnitLost and UnitRejoined events",
        describe=lambda: str(events(api, namespace, "heal")),
    )
    wait_for(lambda: phase_is(api, namespace, "heal", "Running", "2/2"), timeout=30, what="still Running")
    assert get_job(api, namespace, "heal")["status"]["phase"] != "Failed"


def test_add_and_remove_a_unit_live(api: k8s.ApiClient, namespace: str, operator: KopfRunner) -> None:
    create_job(api, namespace, job_manifest("live", [unit("a")]))
    wait_for(lambda: phase_is(api, namespace, "live", "Running", "1/1"), timeout=90, what="phase Running")
    patch_spec(api, namespace, "live", {"learnerUnits": [unit("a"), unit("b", 2)]})
    wait_for(
        lambda: running_on_kwok(learner_pods(api, namespace, "live", "b"), 2),
        timeout=60,
        what="unit b running",
    )
    wait_for(lambda: phase_is(api, namespace, "live", "Running", "2/2"), timeout=30, what="2/2 units ready")
    (a_pod,) = (p.metadata.name for p in learner_pods(api, namespace, "live", "a"))
    with PodDeletions(api, namespace, "diloco.dev/job=live,diloco.dev/unit=a") as deletions:
        patch_spec(api, namespace, "live", {"learnerUnits": [unit("b", 3)]})
        wait_for(
            lambda: children(api, namespace, "live") == expected_children("live", ["b"]),
            timeout=60,
            what="unit a removed",
            describe=lambda: str(children(api, namespace, "live")),
        )
        wait_for(
            lambda: running_on_kwok(learner_pods(api, namespace, "live", "b"), 3),
            timeout=60,
            what="b scaled to 3",
        )
        wait_for(lambda: not learner_pods(api, namespace, "live", "a"), timeout=60, what="unit a's pods gone")
        # Drained, not killed: the removed unit's pod was deleted with its full grace period (the
        # learner's SIGTERM handler leaves the job cleanly), never forced.
        wait_for(
            lambda: a_pod in deletions.seen,
            timeout=30,
            what="the deletion of unit a's pod observed",
            describe=lambda: f"{deletions.seen}, watch error {deletions.error!r}",
        )
    assert deletions.seen == {a_pod: TERMINATION_GRACE_SECONDS}
    assert TERMINATION_GRACE_SECONDS > 0


def test_suspend_and_resume(api: k8s.ApiClient, namespace: str, operator: KopfRunner) -> None:
    create_job(api, namespace, job_manifest("nap", [unit("a", 2)]))
    wait_for(lambda: phase_is(api, namespace, "nap", "Running"), timeout=90, what="phase Running")
    patch_spec(api, namespace, "nap", {"suspend": True})
    wait_for(lambda: phase_is(api, namespace, "nap", "Suspended"), timeout=30, what="phase Suspended")
    wait_for(lambda: not learner_pods(api, namespace, "nap"), timeout=60, what="learner pods gone")
    apps = k8s.AppsV1Api(api)
    assert apps.read_namespaced_deployment("nap-sync", namespace).spec.replicas == 0
    assert apps.read_namespaced_stateful_set("nap-a", namespace).spec.replicas == 0
    patch_spec(api, namespace, "nap", {"suspend": False})
    wait_for(lambda: running_on_kwok(learner_pods(api, namespace, "nap"), 2), timeout=60, what="pods back")
    wait_for(lambda: phase_is(api, namespace, "nap", "Running", "1/1"), timeout=30, what="Running again")


def test_deleting_the_job_removes_everything(
    api: k8s.ApiClient, namespace: str, operator: KopfRunner
) -> None:
    create_job(api, namespace, job_manifest("gone", [unit("a"), unit("b")]))
    wait_for(
        lambda: children(api, namespace, "gone") == expected_children("gone", ["a", "b"]),
        timeout=60,
        what="children",
    )
    k8s.CustomObjectsApi(api).delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "gone")
    empty = {k: [] for k in expected_children("gone", [])}
    wait_for(
        lambda: children(api, namespace, "gone") == empty,
        timeout=90,
        what="garbage collection",
        describe=lambda: str(children(api, namespace, "gone")),
    )
    wait_for(lambda: not learner_pods(api, namespace, "gone"), timeout=60, what="pods gone")


def test_invalid_spec_reports_and_creates_nothing(
    api: k8s.ApiClient, namespace: str, operator: KopfRunner
) -> None:
    storage = {"bucket": "diloco-test", "credentialsSecretRef": {"name": "missing-creds"}}
    create_job(api, namespace, job_manifest("bad", [unit("a")], storage=storage))

    def failed() -> bool:
        status = get_job(api, namespace, "bad").get("status") or {}
        valid = {c["type"]: c for c in status.get("conditions", [])}.get("SpecValid", {})
        return (
            status.get("phase") == "Failed"
            and valid.get("reason") == "InvalidSpec"
            and "missing-creds" in valid.get("message", "")
        )

    wait_for(failed, timeout=30, what="Failed with an InvalidSpec condition")
    wait_for(lambda: "InvalidSpec" in events(api, namespace, "bad"), timeout=30, what="InvalidSpec event")
    time.sleep(5)  # two resync periods: nothing may appear and the operator must keep running
    assert children(api, namespace, "bad") == {k: [] for k in expected_children("bad", [])}
    assert not operator.future.done()  # no crash
    # Fixing the reference makes the job valid without touching it again.
    k8s.CoreV1Api(api).create_namespaced_secret(
        namespace,
        {
            "metadata": {"name": "missing-creds"},
            "stringData": {"AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "key"},
        },
    )
    wait_for(
        lambda: phase_is(api, namespace, "bad", "Running"), timeout=90, what="Running once the Secret exists"
    )


def test_schema_rejects_impossible_settings(api: k8s.ApiClient, namespace: str) -> None:
    manifest = job_manifest("cel", [unit("a")], diloco={"quorum": 2, "innerSteps": 4, "overlap": 4})
    with pytest.raises(ApiException) as err:
        create_job(api, namespace, manifest)
    assert err.value.status == 422
    assert "overlap must be smaller" in err.value.body
    assert "quorum must not exceed" in err.value.body


def test_examples_are_accepted_by_the_apiserver(api: k8s.ApiClient, namespace: str) -> None:
    custom = k8s.CustomObjectsApi(api)
    fields = schema()["properties"]["spec"]["properties"]["diloco"]["properties"]
    defaults = {name: field["default"] for name, field in fields.items() if "default" in field}
    docs = example_docs()
    assert len(docs) >= 2
    for _, doc in docs:
        created = custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, doc, dry_run="All"
        )
        given = doc["spec"].get("diloco", {})
        diloco = created["spec"]["diloco"]
        # what the example sets is kept, what it leaves out gets the schema's default
        assert {k: diloco[k] for k in given} == given
        assert {k: diloco[k] for k in defaults if k not in given} == {
            k: v for k, v in defaults.items() if k not in given
        }


def test_restarting_the_operator_makes_no_duplicates(api: k8s.ApiClient, namespace: str) -> None:
    with start_operator() as first:
        create_job(api, namespace, job_manifest("twice", [unit("a", 2), unit("b")]))
        wait_for(
            lambda: phase_is(api, namespace, "twice", "Running", "2/2"), timeout=90, what="phase Running"
        )
    assert first.exception is None
    before = children(api, namespace, "twice")
    secret = k8s.CoreV1Api(api).read_namespaced_secret("twice-secret", namespace).data
    uids = {p.metadata.uid for p in learner_pods(api, namespace, "twice")}
    with start_operator() as second:
        time.sleep(6)  # resume handler plus two resync periods
        assert children(api, namespace, "twice") == before == expected_children("twice", ["a", "b"])
        assert k8s.CoreV1Api(api).read_namespaced_secret("twice-secret", namespace).data == secret
        assert {p.metadata.uid for p in learner_pods(api, namespace, "twice")} == uids
        assert phase_is(api, namespace, "twice", "Running", "2/2")
    assert second.exception is None


def test_liveness_and_metrics(api: k8s.ApiClient, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    metrics_port, live_port = free_port(), free_port()
    monkeypatch.setenv("DILOCO_OPERATOR_METRICS_PORT", str(metrics_port))
    with start_operator(f"--liveness=http://127.0.0.1:{live_port}/healthz") as runner:
        create_job(api, namespace, job_manifest("seen", [unit("a")]))
        wait_for(lambda: phase_is(api, namespace, "seen", "Running"), timeout=90, what="phase Running")
        live = wait_for(
            lambda: httpx.get(f"http://127.0.0.1:{live_port}/healthz", timeout=5),
            timeout=30,
            what="liveness endpoint",
        )
        assert live.status_code == 200
        assert live.json()["api"] == "ok"
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        running = [
            line
            for line in text.splitlines()
            if line.startswith("diloco_operator_job_phase{")
            and 'job="seen"' in line
            and 'phase="Running"' in line
        ]
        assert running == [running[0]]
        assert running[0].endswith(" 1.0")
        assert 'diloco_operator_children_total{action="created"}' in text
    assert runner.exception is None


def test_chaos_kills_learner_pods_and_counts_them(
    api: k8s.ApiClient, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DILOCO_OPERATOR_ALLOW_CHAOS", "true")  # the operator's key (--allow-chaos)
    with start_operator() as runner:
        chaos = {"enabled": True, "mtbfSeconds": 1, "units": ["a"]}
        create_job(api, namespace, job_manifest("game", [unit("a"), unit("b")], chaos=chaos))
        wait_for(
            lambda: (get_job(api, namespace, "game").get("status") or {}).get("chaos", {}).get("kills", 0)
            >= 2,
            timeout=60,
            what="two chaos kills",
        )
        wait_for(
            lambda: "ChaosKill" in events(api, namespace, "game"),
            timeout=30,
            what="ChaosKill event",
            describe=lambda: str(events(api, namespace, "game")),
        )
        assert condition(get_job(api, namespace, "game"), "Chaos")[:2] == ("True", "Enabled")
        (b_pod,) = learner_pods(api, namespace, "game", "b")
        patch_spec(api, namespace, "game", {"chaos": {"enabled": False}})
        wait_for(
            lambda: running_on_kwok(learner_pods(api, namespace, "game"), 2),
            timeout=60,
            what="both units back",
        )
        assert (
            learner_pods(api, namespace, "game", "b")[0].metadata.uid == b_pod.metadata.uid
        )  # unit b untouched
    assert runner.exception is None


def condition(job: dict[str, Any], ctype: str) -> tuple[str, str, str] | None:
    for c in (job.get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return c["status"], c["reason"], c["message"]
    return None


def _await_chaos_said(api: k8s.ApiClient, namespace: str, job: str, reason: str, event: str) -> None:
    """The job's Chaos condition is False with ``reason``, and the ``event`` was posted."""
    wait_for(
        lambda: (condition(get_job(api, namespace, job), "Chaos") or ("",))[:2] == ("False", reason),
        timeout=30,
        what=f"the Chaos condition {reason}",
    )
    wait_for(
        lambda: event in events(api, namespace, job),
        timeout=30,
        what=f"the {event} event",
        describe=lambda: str(events(api, namespace, job)),
    )


def test_chaos_is_refused_unless_the_operator_allows_it(
    api: k8s.ApiClient, namespace: str, operator: KopfRunner
) -> None:
    chaos = {"enabled": True, "mtbfSeconds": 0.001}  # would kill a pod on every resync
    create_job(api, namespace, job_manifest("nogame", [unit("a")], chaos=chaos))
    wait_for(lambda: phase_is(api, namespace, "nogame", "Running", "1/1"), timeout=90, what="phase Running")
    _await_chaos_said(api, namespace, "nogame", "NotAllowed", "ChaosRefused")
    (pod,) = learner_pods(api, namespace, "nogame")
    time.sleep(5)  # two resync periods, each of which would have killed the pod
    assert [p.metadata.uid for p in learner_pods(api, namespace, "nogame")] == [pod.metadata.uid]
    status = get_job(api, namespace, "nogame")["status"]
    assert status["chaos"]["kills"] == 0
    assert "ChaosKill" not in events(api, namespace, "nogame")
    assert events(api, namespace, "nogame").count("ChaosRefused") == 1
    # Failure parameters without enabled: true: said so, and still nothing killed.
    patch_spec(api, namespace, "nogame", {"chaos": {"enabled": False, "mtbfSeconds": 5}})
    _await_chaos_said(api, namespace, "nogame", "NotEnabled", "ChaosNotEnabled")
    assert [p.metadata.uid for p in learner_pods(api, namespace, "nogame")] == [pod.metadata.uid]


@pytest.mark.slow
def test_fifty_units_reconcile_completely(
    api: k8s.ApiClient, namespace: str, operator: KopfRunner, record_property: Any
) -> None:
    units = [unit(f"u{i:02d}") for i in range(50)]
    started = time.monotonic()
    create_job(api, namespace, job_manifest("big", units, diloco={"quorum": 25}))
    wait_for(
        lambda: phase_is(api, namespace, "big", "Running", "50/50"),
        timeout=300,
        what="50/50 units ready",
        interval=1.0,
        describe=lambda: str((get_job(api, namespace, "big").get("status") or {}).get("unitsReady")),
    )
    elapsed = time.monotonic() - started
    # KopfRunner's click runner swaps sys.stdout while the operator runs: report on the real one.
    sys.__stdout__.write(f"\n[scale] 50 learner units reconciled and ready in {elapsed:.1f} s\n")
    record_property("fifty_units_ready_s", round(elapsed, 1))
    assert children(api, namespace, "big") == expected_children("big", [f"u{i:02d}" for i in range(50)])
    assert running_on_kwok(learner_pods(api, namespace, "big"), 50)


def test_events_posted_by_the_operator_client_show_on_the_job(api: k8s.ApiClient, namespace: str) -> None:
    """``events.k8s.io/v1`` Events created through ``Kube`` are listed on the job by the core API."""
    create_job(api, namespace, job_manifest("ev", [unit("a")]))
    job = get_job(api, namespace, "ev")
    post_events(
        Kube(api),
        job,
        [Event("Warning", "QuorumLost", "quorum lost"), Event("Normal", "Running", "ok")],
        "test",
    )
    items = k8s.CoreV1Api(api).list_namespaced_event(namespace, field_selector="involvedObject.name=ev").items
    assert sorted((e.reason, e.message, e.involved_object.uid) for e in items) == [
        ("QuorumLost", "quorum lost", job["metadata"]["uid"]),
        ("Running", "ok", job["metadata"]["uid"]),
    ]
    # Gone before the namespace is: operators of later tests watch every namespace.
    k8s.CustomObjectsApi(api).delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "ev")
    wait_for(
        lambda: not k8s.CustomObjectsApi(api).list_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL
        )["items"],
        timeout=30,
        what="the job deleted",
    )


def test_api_error_is_one_line_with_the_apiservers_message() -> None:
    exc = ApiException(status=422, reason="Unprocessable Entity")
    exc.body = b'{"kind":"Status","message":"Event \\"x\\" is invalid"}'
    assert api_error(exc) == 'HTTP 422: Event "x" is invalid'
    assert (
        api_error(ApiException(status=503, reason="Service Unavailable")) == "HTTP 503: Service Unavailable"
    )
    assert api_error(TimeoutError("read timed out")) == "TimeoutError: read timed out"
