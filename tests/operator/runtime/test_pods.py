"""What the pod watch tells: pure decisions (tables), then against the real control plane a unit the
scheduler cannot place, and a resized unit whose pods restart together while the others stay."""

from __future__ import annotations

import time
from typing import Any

import pytest
from diloco_operator.runtime.pods import (
    PodCache,
    PodWatch,
    Restart,
    outdated_pods,
    restarting_into,
    restarts_under_way,
    sync_image_problem,
    sync_observation,
    sync_storage_conflict,
    unit_observations,
)
from diloco_operator.schema.spec import parse_spec
from diloco_operator.status.pods import observe_pod
from diloco_testbed.waiting import wait_for
from kopf.testing import KopfRunner
from kubernetes import client as k8s

from tests.operator.kubejobs import (
    PodDeletions,
    create_job,
    events,
    get_job,
    job_manifest,
    learner_pods,
    patch_spec,
    phase_is,
    running_on_kwok,
    unit,
)

SPEC = parse_spec(
    {
        "images": {"worker": "w", "synchronizer": "s"},
        "storage": {"bucket": "bkt"},
        "learnerUnits": [{"name": "a", "replicas": 2}, {"name": "b"}],
        "synchronizer": {"shards": 2},
    }
)
UNSCHEDULABLE = {
    "type": "PodScheduled",
    "status": "False",
    "reason": "Unschedulable",
    "message": "0/4 nodes are available: 4 node(s) didn't match Pod's node affinity/selector.",
}


def pod(
    name: str,
    *,
    unit: str = "",
    shard: str = "",
    ready: bool = True,
    deleting: bool = False,
    conditions: list[dict[str, Any]] | None = None,
    template: str = "t1",
    uid: str = "",
) -> dict[str, Any]:
    labels = {"diloco.dev/job": "j", "app.kubernetes.io/component": "learner" if unit else "synchronizer"}
    labels |= {"diloco.dev/unit": unit} if unit else {"diloco.dev/shard": shard}
    meta: dict[str, Any] = {
        "name": name,
        "namespace": "ns",
        "uid": uid or f"uid-{name}",
        "labels": labels,
        "annotations": {"diloco.dev/template-hash": template},
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    conds = (
        conditions if conditions is not None else [{"type": "Ready", "status": "True" if ready else "False"}]
    )
    return {"metadata": meta, "status": {"phase": "Running" if ready else "Pending", "conditions": conds}}


def warnings(api: k8s.ApiClient, ns: str, job: str) -> list[str]:
    """The reasons of the Warning events about the job."""
    items = k8s.CoreV1Api(api).list_namespaced_event(ns, field_selector=f"involvedObject.name={job}").items
    return [e.reason for e in items if e.type == "Warning"]


def test_observe_pod_reads_readiness_the_schedulers_message_and_the_template() -> None:
    seen = observe_pod(pod("j-a-0", unit="a", conditions=[UNSCHEDULABLE], template="t9"))
    assert (seen.unit, seen.component, seen.ready, seen.template) == ("a", "learner", False, "t9")
    assert seen.unschedulable.startswith("0/4 nodes are available")
    assert observe_pod(pod("j-a-0", unit="a")).unschedulable == ""


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        (
            {"containerStatuses": [{"name": "learner", "image": "w:typo", "state": {"waiting": {
                "reason": "ImagePullBackOff", "message": 'Back-off pulling image "w:typo"'}}}]},
            "image 'w:typo' (learner): ImagePullBackOff: Back-off pulling image \"w:typo\"",
        ),
        (
            {"initContainerStatuses": [{"name": "init", "image": "i:1", "state": {"waiting": {
                "reason": "ErrImagePull"}}}], "containerStatuses": []},
            "image 'i:1' (init): ErrImagePull",
        ),
        ({"containerStatuses": [{"name": "learner", "state": {"waiting": {"reason": "ContainerCreating"}}}]}, ""),
        ({"containerStatuses": [{"name": "learner", "state": {"running": {}}}]}, ""),
        ({}, ""),
    ],
)  # fmt: skip
def test_a_pod_that_cannot_get_its_image_says_which_and_why(statuses: dict[str, Any], expected: str) -> None:
    obj = pod("j-a-0", unit="a", ready=False)
    obj["status"] |= statuses
    seen = observe_pod(obj)
    assert seen.image_problem == expected
    assert unit_observations(SPEC, [seen])[0].image_problem == expected
    sync = pod("j-sync-0", shard="0", ready=False)
    sync["status"] |= statuses
    assert sync_image_problem([observe_pod(sync)]) == expected


def test_units_and_synchronizer_as_their_pods_show_them() -> None:
    pods = [
        observe_pod(p)
        for p in (
            pod("j-a-0", unit="a"),
            pod("j-a-1", unit="a", ready=False),
            pod("j-b-0", unit="b", ready=False, conditions=[UNSCHEDULABLE]),
            pod("j-sync-0", shard="0"),
            pod("j-sync-1", shard="1", deleting=True),
        )
    ]
    a, b = unit_observations(SPEC, pods)
    assert (a.name, a.ready_replicas, a.exists, a.unschedulable) == ("a", 1, True, "")
    assert (b.ready_replicas, b.unschedulable[:4]) == (0, "0/4 ")
    # shard 1's only pod is going away: not every shard is ready
    assert sync_observation(SPEC, pods) == (False, "")
    assert sync_observation(SPEC, [*pods, observe_pod(pod("j-sync-1-x", shard="1"))])[0] is True


def exited(obj: dict[str, Any], message: str, *, now: bool = False) -> dict[str, Any]:
    """``obj`` with its container's termination message: of its current state (``now``: it ended)
    or of its last one (restarted)."""
    terminated = {"terminated": {"exitCode": 1, "message": message}}
    container = {"state": terminated} if now else {"state": {"waiting": {}}, "lastState": terminated}
    return {**obj, "status": {**obj["status"], "containerStatuses": [container]}}


def test_a_synchronizer_refusing_its_storage_prefix_is_told_by_its_last_exit() -> None:
    refusal = "storage prefix owned by another job: s3://b/p/job.json names 'x/j'"
    told = f"INFO stopping\ndiloco synchronizer: cannot start: {refusal}\n"
    assert observe_pod(exited(pod("j-sync-0", shard="0", ready=False), told)).message == told
    assert observe_pod(exited(pod("e-0", shard="0"), "summary", now=True)).message == "summary"
    assert (
        sync_storage_conflict([observe_pod(exited(pod("j-sync-0", shard="0", ready=False), told))]) == refusal
    )
    for other in (
        exited(pod("j-sync-0", shard="0"), told),  # ready: it runs now
        exited(pod("j-sync-0", shard="0", ready=False, deleting=True), told),
        exited(pod("j-a-0", unit="a", ready=False), told),
        exited(pod("j-sync-0", shard="0", ready=False), "ERROR storage unavailable"),
        pod("j-sync-0", shard="0", ready=False),
    ):
        assert sync_storage_conflict([observe_pod(other)]) == ""


def test_outdated_pods_are_those_of_another_template_not_yet_deleted() -> None:
    pods = [
        observe_pod(p)
        for p in (
            pod("j-a-0", unit="a", template="old"),
            pod("j-a-1", unit="a", template="new"),
            pod("j-a-2", unit="a", template="old", deleting=True),
            pod("j-b-0", unit="b", template="old"),
            pod("j-sync-0", shard="0", template="old"),
        )
    ]
    out = outdated_pods(pods, {"a": "new", "b": "old"})
    assert {u: [p.name for p in ps] for u, ps in out.items()} == {"a": ["j-a-0"]}


def test_pod_cache_keeps_the_latest_view_and_ignores_a_late_deletion_of_a_replaced_pod() -> None:
    cache = PodCache()
    assert cache.update(pod("j-a-0", unit="a", uid="1"), deleted=False) == ("ns", "j")
    cache.update(pod("j-a-0", unit="a", uid="2", ready=False), deleted=False)  # its replacement
    cache.update(pod("j-a-0", unit="a", uid="1"), deleted=True)  # the old one's last event, late
    assert [(p.uid, p.ready) for p in cache.pods("ns", "j")] == [("2", False)]
    cache.update(pod("j-a-0", unit="a", uid="2"), deleted=True)
    assert cache.pods("ns", "j") == []
    assert cache.update({"metadata": {"name": "x", "namespace": "ns"}}, deleted=False) is None


def test_pod_watch_reports_lost_and_rejoined() -> None:
    watch = PodWatch()

    def see(phase: str, ready: bool, deleted: bool = False, key: str = "ns/j-a-0") -> str | None:
        ev = watch.observe(key, "a", phase=phase, ready=ready, deleted=deleted)
        return ev.reason if ev else None

    assert [see("Pending", False), see("Running", True), see("Running", True)] == [None, None, None]
    assert see("Failed", False) == "UnitLost"
    assert see("Failed", False, deleted=True) is None  # the StatefulSet removes the failed pod
    assert [see("Pending", False), see("Running", True)] == [None, "UnitRejoined"]
    assert see("Running", False) == "UnitLost"  # crashed: ready no more, not being deleted
    assert see("Running", True) == "UnitRejoined"
    # Scaling down, suspending or restarting for a new template deletes healthy pods: no loss.
    assert [see("Running", True, deleted=True, key="ns/j-a-1"), see("Running", False, deleted=True)] == [
        None,
        None,
    ]


def test_a_pod_deleted_on_purpose_that_ends_failed_is_no_loss() -> None:
    """Suspending, scaling down or restarting a unit deletes its pods; the kubelet then gives each
    one whose container ended on SIGTERM the phase Failed. That is the deletion, not a failure."""
    watch = PodWatch()
    assert watch.observe("ns/j-a-0", "a", phase="Running", ready=True, deleted=False) is None
    assert watch.observe("ns/j-a-0", "a", phase="Running", ready=True, deleted=True) is None
    assert watch.observe("ns/j-a-0", "a", phase="Running", ready=False, deleted=True) is None
    assert watch.observe("ns/j-a-0", "a", phase="Failed", ready=False, deleted=True) is None
    # a pod that fails on its own is still a loss
    assert watch.observe("ns/j-b-0", "b", phase="Running", ready=True, deleted=False) is None
    ev = watch.observe("ns/j-b-0", "b", phase="Failed", ready=False, deleted=False)
    assert ev is not None
    assert (ev.type, ev.reason) == ("Warning", "UnitLost")
    # and so is one first seen Failed while its StatefulSet already deletes it (it failed first)
    assert watch.observe("ns/j-c-0", "c", phase="Running", ready=True, deleted=False) is None
    ev = watch.observe("ns/j-c-0", "c", phase="Failed", ready=False, deleted=True)
    assert ev is not None
    assert ev.reason == "UnitLost"
    # a pod deleted on purpose that is gone leaves nothing behind for its replacement of the same name
    assert watch.observe("ns/j-a-0", "a", phase="Failed", ready=False, deleted=True, gone=True) is None
    assert watch.observe("ns/j-a-0", "a", phase="Running", ready=True, deleted=False) is None
    ev = watch.observe("ns/j-a-0", "a", phase="Failed", ready=False, deleted=False)
    assert ev is not None
    assert ev.reason == "UnitLost"


@pytest.mark.parametrize(
    ("pods", "age", "under_way"),
    [
        ([], 10.0, True),  # the outdated pods are gone, the replacements not yet created
        ([pod("j-a-0", unit="a", template="old"), pod("j-a-1", unit="a", template="old")], 0.0, True),
        ([pod("j-a-0", unit="a", template="old", deleting=True)], 5.0, True),
        (
            [pod("j-a-0", unit="a", template="new"), pod("j-a-1", unit="a", template="new", ready=False)],
            5.0,
            True,
        ),
        ([pod("j-a-0", unit="a", template="new")], 5.0, True),  # one of its two pods
        # back: both its pods ready, from the current template
        (
            [pod("j-a-0", unit="a", template="new"), pod("j-a-1", unit="a", template="new")],
            5.0,
            False,
        ),
        ([], 301.0, False),  # past unitLostAfterSeconds (300): a loss like any other from now on
    ],
)
def test_a_restart_is_under_way_until_the_unit_is_back_or_unit_lost_after_has_passed(
    pods: list[dict[str, Any]], age: float, under_way: bool
) -> None:
    seen = [observe_pod(p) for p in pods]
    out = restarts_under_way(SPEC, seen, {"a": Restart(1000.0, "new")}, 1000.0 + age)
    assert out == ({"a": Restart(1000.0, "new")} if under_way else {})


def test_a_restart_of_a_unit_removed_from_the_spec_is_over() -> None:
    assert restarts_under_way(SPEC, [], {"gone": Restart(1000.0, "new")}, 1001.0) == {}


def test_a_restart_into_a_template_the_unit_no_longer_has_is_outdated_but_still_no_loss() -> None:
    """The image corrected while the restarted unit's pods cannot pull the wrong one: the restart
    still counts (no loss) until unitLostAfterSeconds, but no longer keeps the rollout from
    restarting the unit into the corrected template."""
    started = {"a": Restart(1000.0, "typo"), "b": Restart(1000.0, "new")}
    seen = [observe_pod(pod("j-a-0", unit="a", template="typo", ready=False))]
    under_way = restarts_under_way(SPEC, seen, started, 1010.0)
    assert under_way == started  # b has no pod yet
    assert restarting_into(under_way, {"a": "fixed", "b": "new"}) == {"b"}
    assert restarting_into(under_way, {"a": "typo", "b": "new"}) == {"a", "b"}
    back = [
        observe_pod(pod("j-a-0", unit="a", template="typo")),
        observe_pod(pod("j-a-1", unit="a", template="typo")),
    ]
    # a is back in the template it was restarted into, though that template is outdated
    assert restarts_under_way(SPEC, back, started, 1010.0) == {"b": Restart(1000.0, "new")}


@pytest.mark.integration
@pytest.mark.kwok  # the other unit's pods must run whatever their image
def test_a_unit_no_node_can_take_says_unschedulable_with_the_schedulers_reason(
    api: k8s.ApiClient, namespace: str, operator: KopfRunner
) -> None:
    gpu = unit("gpu", 1, nodeSelector={"example.com/gpu-type": "h100"})  # no kwok node has it
    create_job(api, namespace, job_manifest("stuck", [unit("a"), gpu], diloco={"quorum": 1}))

    def scheduled() -> tuple[str, str, str] | None:
        for c in (get_job(api, namespace, "stuck").get("status") or {}).get("conditions") or []:
            if c["type"] == "PodsScheduled":
                return c["status"], c["reason"], c["message"]
        return None

    cond = wait_for(
        lambda: (c := scheduled()) and c[0] == "False" and c,
        timeout=90,
        what="PodsScheduled False",
        describe=lambda: str(get_job(api, namespace, "stuck").get("status")),
    )
    assert cond[1] == "Unschedulable"
    assert cond[2].startswith("unit gpu: 0/")
    assert "didn't match Pod's node affinity/selector" in cond[2]
    units = {u["name"]: u for u in get_job(api, namespace, "stuck")["status"]["units"]}
    assert (units["gpu"]["reason"], units["gpu"]["state"]) == ("Unschedulable", "NotReady")
    assert "didn't match" in units["gpu"]["message"]
    wait_for(  # the other unit's pod is placed, and ready once kwok says so
        lambda: {u["name"]: u for u in get_job(api, namespace, "stuck")["status"]["units"]}["a"]["reason"]
        == "Ready",
        timeout=60,
        what="unit a ready",
    )
    wait_for(
        lambda: "Unschedulable" in events(api, namespace, "stuck"), timeout=30, what="the Unschedulable event"
    )
    notes = [
        e.message
        for e in k8s.CoreV1Api(api)
        .list_namespaced_event(namespace, field_selector="involvedObject.name=stuck")
        .items
        if e.reason == "Unschedulable"
    ]
    assert notes == [cond[2]]
    wait_for(lambda: phase_is(api, namespace, "stuck", "Running", "1/2"), timeout=30, what="Running 1/2")
    time.sleep(5)  # two resync periods, and the pod events between them: still one event, not one per pass
    assert events(api, namespace, "stuck").count("Unschedulable") == 1
    # A node selector that matches: the unit is placed and the condition clears.
    patch_spec(
        api,
        namespace,
        "stuck",
        {
            "learnerUnits": [
                unit("a"),
                unit("gpu", 1, nodeSelector={"topology.kubernetes.io/region": "region-a"}),
            ]
        },
    )
    wait_for(lambda: (c := scheduled()) and c[0] == "True", timeout=90, what="PodsScheduled True")
    wait_for(lambda: phase_is(api, namespace, "stuck", "Running", "2/2"), timeout=60, what="Running 2/2")


@pytest.mark.integration
@pytest.mark.kwok
def test_resizing_a_unit_restarts_its_pods_together_and_no_other(
    api: k8s.ApiClient, namespace: str, operator: KopfRunner
) -> None:
    create_job(api, namespace, job_manifest("grow", [unit("a", 2), unit("b", 1)], diloco={"quorum": 2}))
    wait_for(lambda: phase_is(api, namespace, "grow", "Running", "2/2"), timeout=90, what="phase Running")
    before = {p.metadata.name: p.metadata.uid for p in learner_pods(api, namespace, "grow")}
    sync_pods = {
        p.metadata.uid
        for p in k8s.CoreV1Api(api)
        .list_namespaced_pod(
            namespace, label_selector="diloco.dev/job=grow,app.kubernetes.io/component=synchronizer"
        )
        .items
    }
    with PodDeletions(api, namespace, "diloco.dev/job=grow,diloco.dev/unit=a") as deletions:
        patch_spec(api, namespace, "grow", {"learnerUnits": [unit("a", 3), unit("b", 1)]})

        def resized() -> bool:
            pods = learner_pods(api, namespace, "grow", "a")
            return running_on_kwok(pods, 3) and not {p.metadata.uid for p in pods} & set(before.values())

        wait_for(
            resized,
            timeout=90,
            what="unit a: 3 pods, none of the old ones",
            describe=lambda: str(
                [(p.metadata.name, p.status.phase) for p in learner_pods(api, namespace, "grow")]
            ),
        )
        wait_for(
            lambda: {"grow-a-0", "grow-a-1"} <= set(deletions.seen), timeout=30, what="both deletions seen"
        )
        replaced = {before["grow-a-0"], before["grow-a-1"]}
        # the watch sees a replacement's readiness some time after the pod runs (later on a loaded machine)
        wait_for(
            lambda: any(
                ready and uid not in replaced and name in ("grow-a-0", "grow-a-1")
                for name, uid, _, ready in deletions.timeline
            ),
            timeout=90,
            what="a replacement pod seen ready",
        )
    # Together: both old pods were deleted, with their grace period, before the replacement of either
    # was ready (a rolling update deletes one, waits for its replacement to be ready, then the next).
    assert deletions.seen == {"grow-a-0": 120, "grow-a-1": 120}
    old = {before["grow-a-0"], before["grow-a-1"]}
    # when each old pod was asked to go: its first event with a deletionTimestamp (a terminating pod
    # goes on sending events until it is gone, which may be after a replacement is ready)
    asked = {}
    for i, (_, uid, deleting, _) in enumerate(deletions.timeline):
        if deleting and uid in old:
            asked.setdefault(uid, i)
    assert set(asked) == old, deletions.timeline
    first_ready = min(
        i
        for i, (name, uid, _, ready) in enumerate(deletions.timeline)
        if ready and uid not in old and name in ("grow-a-0", "grow-a-1")
    )
    # Both deletions come from one pass (the one UnitRestart event below names both pods). The pass
    # deletes them one API call apart, and kwok readies a pod the instant it is created, so on a loaded
    # machine the second deletion can be observed just after the first replacement is ready; a rolling
    # update would wait for that readiness before deleting the next pod, which one pass never does.
    assert min(asked.values()) < first_ready, deletions.timeline
    restarts = [
        e
        for e in k8s.CoreV1Api(api)
        .list_namespaced_event(namespace, field_selector="involvedObject.name=grow")
        .items
        if e.reason == "UnitRestart"
    ]
    assert len(restarts) == 1
    assert restarts[0].type == "Normal"
    assert restarts[0].message.startswith("unit a: ")
    assert "(grow-a-0, grow-a-1)" in restarts[0].message  # deleted in one pass
    assert "restart together" in restarts[0].message
    assert "torch.distributed group" in restarts[0].message
    # The other unit and the synchronizer kept their pods.
    assert [p.metadata.uid for p in learner_pods(api, namespace, "grow", "b")] == [before["grow-b-0"]]
    assert {
        p.metadata.uid
        for p in k8s.CoreV1Api(api)
        .list_namespaced_pod(
            namespace, label_selector="diloco.dev/job=grow,app.kubernetes.io/component=synchronizer"
        )
        .items
    } == sync_pods
    wait_for(lambda: phase_is(api, namespace, "grow", "Running", "2/2"), timeout=60, what="Running again")
    assert warnings(api, namespace, "grow") == []  # the operator's own restart: no QuorumLost, no UnitLost


@pytest.mark.integration
@pytest.mark.kwok
def test_a_unit_the_operator_restarts_is_no_loss_until_unit_lost_after_has_passed(
    api: k8s.ApiClient, namespace: str, operator: KopfRunner
) -> None:
    """A new pod template restarts unit a; its new pod finds no node. The job, at quorum only with
    unit a, stays Running (QuorumMet False, reason UnitsRestarting) and raises no QuorumLost until
    ``unitLostAfterSeconds`` has passed; then it is Degraded like for any other loss."""
    spec = {"diloco": {"quorum": 2}, "unitLostAfterSeconds": 20}
    create_job(api, namespace, job_manifest("swap", [unit("a"), unit("b")], **spec))
    wait_for(lambda: phase_is(api, namespace, "swap", "Running", "2/2"), timeout=90, what="phase Running")
    nowhere = {"example.com/gpu-type": "h100"}  # no kwok node has it
    patch_spec(api, namespace, "swap", {"learnerUnits": [unit("a", nodeSelector=nowhere), unit("b")]})

    def quorum() -> tuple[str, str, str]:
        status = get_job(api, namespace, "swap").get("status") or {}
        cond = next(c for c in status.get("conditions") or [] if c["type"] == "QuorumMet")
        return status.get("phase", ""), cond["status"], cond["reason"]

    wait_for(
        lambda: quorum() == ("Running", "False", "UnitsRestarting"),
        timeout=30,  # the restart lasts 20s from the deletion of the outdated pod
        interval=0.2,
        what="Running while unit a restarts",
        describe=lambda: str(quorum()),
    )
    assert set(warnings(api, namespace, "swap")) <= {"Unschedulable"}  # its new pod finds no node
    assert "UnitRestart" in events(api, namespace, "swap")
    wait_for(
        lambda: quorum() == ("Degraded", "False", "BelowQuorum"),
        timeout=60,
        what="Degraded once unitLostAfterSeconds has passed",
        describe=lambda: str(quorum()),
    )
    wait_for(lambda: "QuorumLost" in events(api, namespace, "swap"), timeout=15, what="the QuorumLost event")
    assert events(api, namespace, "swap").count("QuorumLost") == 1
