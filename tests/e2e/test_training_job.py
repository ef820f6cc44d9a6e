"""`helm install`, `kubectl apply`, and a model trains: the whole product as pods.

The operator runs from the chart, SeaweedFS is the S3 server, and a small CPU DiLoCoJob with two
learner units (one of two pods joined by gloo) trains the built-in GPT. On the way: a learner pod
is deleted and resumes from its checkpoint while the other unit keeps training; the synchronizer
pod is killed and the job recovers with no version lost; the job is suspended and resumed from the
stored state; it ends Succeeded with no restart and no warning, and deleting it leaves nothing.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from diloco_core.config import ModelSettings
from diloco_testbed.pods import pod_logs
from diloco_testbed.waiting import wait_for
from kubernetes import client as k8s

from tests.e2e.cluster import E2ECluster
from tests.e2e.stack import (
    SMALL,
    TINY_MODEL,
    Synchronizer,
    exists,
    job_status,
    printed_columns,
    restarts,
    run_tool,
    tiny_job,
    warning_events,
)
from tests.worker.helpers import held_out_loss

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow]

JOB = "tiny"
MODEL = TINY_MODEL
LONG = 1_000_000  # the step budget while failures are tried; then it is brought near
TAIL_STEPS = 40  # the budget, brought near: this far past the furthest learner when the job is suspended


def job_manifest(e2e: E2ECluster) -> dict[str, Any]:
    return tiny_job(
        e2e,
        JOB,
        train={"lr": 3e-3, "warmupSteps": 10},
        diloco={
            "innerSteps": 8,
            "fragments": 2,
            "overlap": 1,
            "quorum": 1,
            "codec": "int8",
            "downCodec": "int4",
        },
        learnerUnits=[
            {"name": "pair", "replicas": 2, "batchSize": 4, "resources": SMALL},
            {"name": "solo", "replicas": 1, "batchSize": 8, "resources": SMALL},
        ],
        budget={"steps": LONG},
    )


class Watch:
    """Samples the job's status and `kubectl get dilocojobs` columns, keeping what it saw."""

    def __init__(self, e2e: E2ECluster, api: k8s.ApiClient, ns: str) -> None:
        self.e2e, self.api, self.ns = e2e, api, ns
        self.sync = Synchronizer(api, ns, JOB)
        self.columns: list[dict[str, str]] = []
        self.restarts: dict[str, int] = {}  # the most restarts seen of each pod of the job
        self.t0 = time.monotonic()

    def status(self) -> dict[str, Any]:
        return job_status(self.api, self.ns, JOB)

    def sample(self) -> dict[str, str]:
        cols = printed_columns(self.e2e, self.ns, JOB)
        self.columns.append(cols)
        for pod, count in restarts(self.api, self.ns).items():
            self.restarts[pod] = max(count, self.restarts.get(pod, 0))
        assert cols["PHASE"] in ("Pending", "Running", "Degraded", "Suspended", "Succeeded"), cols
        ready, _, total = cols["UNITS"].partition("/")
        assert total == "2", cols
        assert 0 <= int(ready) <= 2, cols
        if cols.get("TOKENS"):
            assert int(cols["TOKENS"]) >= 0, cols
        return cols

    def until(self, what: str, probe: Any, timeout: float = 600) -> Any:
        def check() -> Any:
            self.sample()
            return probe()

        return wait_for(check, timeout=timeout, what=what, interval=3,
                        describe=lambda: f"status {self.status()}; last columns {self.columns[-1:]}")  # fmt: skip

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


def _learner_pods(api: k8s.ApiClient, ns: str, unit: str) -> list[Any]:
    return k8s.CoreV1Api(api).list_namespaced_pod(
        ns, label_selector=f"diloco.dev/job={JOB},diloco.dev/unit={unit}").items  # fmt: skip


def _steps(sync: Synchronizer) -> dict[str, int]:
    return {lr["learner_id"]: lr["step"] for lr in sync.status()["learners"]}


@pytest.mark.timeout(2400)
def test_a_job_applied_with_kubectl_trains_survives_failures_and_finishes_cleanly(
    e2e: E2ECluster, api: k8s.ApiClient, storage_secret: str, jobs_namespace: str, operator: str, tmp_path: Path,
) -> None:  # fmt: skip
    ns = jobs_namespace
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(job_manifest(e2e)))
    watch = Watch(e2e, api, ns)
    run_tool("kubectl", "apply", "-n", ns, "-f", str(manifest), env=e2e.kube.env())
    start_loss = held_out_loss(None, _model_settings())

    # training starts: a merged round, the job Running with both units ready
    watch.until("the first merged round", lambda: (watch.status().get("rounds") or 0) >= 1)
    first_round_s = watch.elapsed()
    watch.until("phase Running, 2/2 units", lambda: watch.sample()["PHASE"] == "Running"
                and watch.columns[-1]["UNITS"] == "2/2")  # fmt: skip
    versions = watch.sync.versions()
    watch.until(
        "global versions advance", lambda: all(v > versions[p] for p, v in watch.sync.versions().items())
    )

    # a learner pod deleted: it comes back, resumes from its checkpoint and rejoins; the other unit goes on
    solo = _learner_pods(api, ns, "solo")[0]
    steps = _steps(watch.sync)
    k8s.CoreV1Api(api).delete_namespaced_pod(solo.metadata.name, ns)
    pair_before = steps[f"{JOB}-pair-0"]
    watch.until(
        "the pair unit trains while solo is away",
        lambda: _steps(watch.sync)[f"{JOB}-pair-0"] > pair_before + 8,
    )
    watch.until("solo back and ready", lambda: any(
        p.metadata.uid != solo.metadata.uid and p.status.phase == "Running"
        and all(c.ready for c in p.status.container_statuses or [])
        for p in _learner_pods(api, ns, "solo")))  # fmt: skip
    watch.until("solo resumed from its checkpoint", lambda: "resumed from checkpoint" in pod_logs(
        k8s.CoreV1Api(api), ns, f"{JOB}-solo-0"))  # fmt: skip
    resumed = [ln for ln in pod_logs(k8s.CoreV1Api(api), ns, f"{JOB}-solo-0").splitlines()
               if "resumed from checkpoint" in ln][-1]  # fmt: skip
    assert int(resumed.split("step=")[1].split()[0]) >= steps[f"{JOB}-solo-0"]
    solo_back = _steps(watch.sync)[f"{JOB}-solo-0"]
    watch.until("solo rejoins and steps on", lambda: _steps(watch.sync)[f"{JOB}-solo-0"] > solo_back)

    # the synchronizer killed: it comes back with every committed version, and rounds go on
    before_kill = watch.sync.versions()
    sync_pod = _sync_pod(api, ns)
    k8s.CoreV1Api(api).delete_namespaced_pod(sync_pod.metadata.name, ns, grace_period_seconds=0)
    watch.until("a new synchronizer serves", lambda: _serves_again(watch.sync, sync_pod.status.pod_ip))
    after_kill = watch.sync.versions()
    assert all(after_kill[p] >= v for p, v in before_kill.items()), (before_kill, after_kill)
    watch.until("rounds go on after the restart", lambda: all(
        v > after_kill[p] for p, v in watch.sync.versions().items()))  # fmt: skip

    # suspended and resumed: everything stops, then continues from the stored state. While nothing
    # runs, the step budget is brought near (a spec change then restarts no pod: a rolling update
    # would break a multi-pod unit's process group and restart its other ranks)
    before_suspend = watch.sync.versions()
    final_step = max(_steps(watch.sync).values()) + TAIL_STEPS  # past where the learners will stop
    _patch(api, ns, {"suspend": True})
    watch.until(
        "phase Suspended with no pods",
        lambda: watch.sample()["PHASE"] == "Suspended"
        and not k8s.CoreV1Api(api).list_namespaced_pod(ns, label_selector=f"diloco.dev/job={JOB}").items,
    )
    _patch(api, ns, {"suspend": False, "budget": {"steps": final_step}})
    watch.until("running again", lambda: watch.sample()["PHASE"] in ("Running", "Succeeded"))
    resumed_versions = watch.sync.versions()
    assert all(resumed_versions[p] >= v for p, v in before_suspend.items()), (
        before_suspend,
        resumed_versions,
    )
    watch.until("solo resumed after the suspension", lambda: "resumed from checkpoint" in pod_logs(
        k8s.CoreV1Api(api), ns, f"{JOB}-solo-0"))  # fmt: skip

    # the end: Succeeded, learners stopped, nothing restarted, no warning
    warnings_before_end = set(warning_events(api, ns))
    watch.until("Succeeded", lambda: watch.sample()["PHASE"] == "Succeeded", timeout=1200)
    succeeded_s = watch.elapsed()
    status = watch.status()
    watch.until("learner units scaled down", lambda: not k8s.CoreV1Api(api).list_namespaced_pod(
        ns, label_selector="app.kubernetes.io/component=learner").items)  # fmt: skip
    final = watch.sync.status()
    assert all(lr["step"] >= final_step for lr in final["learners"]), final["learners"]
    assert {lr["state"] for lr in final["learners"]} == {"left"}, final["learners"]
    assert status["tokens"] > 0, status
    assert final["tokens"] == status["tokens"], (status["tokens"], final["tokens"])
    cols = watch.sample()
    assert cols["PHASE"] == "Succeeded", cols
    assert int(cols["TOKENS"]) == status["tokens"], cols
    end_loss = held_out_loss(watch.sync.global_params(), _model_settings())
    print(
        f"\n[e2e] held-out loss {start_loss:.3f} -> {end_loss:.3f}; first merged round {first_round_s:.0f}s "
        f"after kubectl apply, Succeeded after {succeeded_s:.0f}s; {len(watch.columns)} status samples"
    )
    assert end_loss < start_loss - 0.3, (start_loss, end_loss)
    assert watch.restarts, "no pod was seen"
    assert watch.restarts == dict.fromkeys(watch.restarts, 0), watch.restarts  # through the whole run
    new_warnings = set(warning_events(api, ns)) - warnings_before_end
    assert not new_warnings, new_warnings
    phases = [c["PHASE"] for c in watch.columns]
    assert phases[-1] == "Succeeded", phases
    assert "Running" in phases, phases

    # the synchronizer restarted after the end still knows how far each learner got and the tokens
    old_pod = _sync_pod(api, ns)
    k8s.CoreV1Api(api).delete_namespaced_pod(old_pod.metadata.name, ns, grace_period_seconds=0)
    watch.until("a new synchronizer serves", lambda: _serves_again(watch.sync, old_pod.status.pod_ip))
    restored = watch.sync.status()
    assert all(lr["step"] >= final_step for lr in restored["learners"]), restored["learners"]
    assert restored["tokens"] == final["tokens"], (restored["tokens"], final["tokens"])
    until = time.monotonic() + 15  # three resyncs of the operator, which reads the new synchronizer
    while time.monotonic() < until:
        cols = watch.sample()
        assert (cols["PHASE"], int(cols["TOKENS"])) == ("Succeeded", status["tokens"]), cols
        time.sleep(1)

    # deleted: nothing of the job is left
    run_tool("kubectl", "delete", "-n", ns, "-f", str(manifest), "--wait=true", env=e2e.kube.env())
    core, apps = k8s.CoreV1Api(api), k8s.AppsV1Api(api)
    wait_for(lambda: not core.list_namespaced_pod(ns, label_selector=f"diloco.dev/job={JOB}").items
             and not apps.list_namespaced_stateful_set(ns, label_selector=f"diloco.dev/job={JOB}").items
             and not apps.list_namespaced_deployment(ns, label_selector=f"diloco.dev/job={JOB}").items
             and not core.list_namespaced_service(ns, label_selector=f"diloco.dev/job={JOB}").items
             and not exists(core.read_namespaced_secret, f"{JOB}-secret", ns)
             and not exists(core.read_namespaced_config_map, f"{JOB}-config", ns),
             timeout=180, what="every child of the job gone")  # fmt: skip


def _model_settings() -> ModelSettings:
    return ModelSettings(n_layer=MODEL["nLayer"], n_head=MODEL["nHead"], n_embd=MODEL["nEmbd"],
                         block_size=MODEL["blockSize"])  # fmt: skip


def _sync_pod(api: k8s.ApiClient, ns: str) -> Any:
    return k8s.CoreV1Api(api).list_namespaced_pod(
        ns, label_selector=f"diloco.dev/job={JOB},app.kubernetes.io/component=synchronizer").items[0]  # fmt: skip


def _serves_again(sync: Synchronizer, old_ip: str) -> bool:
    url = sync.url()
    return old_ip not in url and bool(sync.status()["fragments"])


def _patch(api: k8s.ApiClient, ns: str, spec: dict[str, Any]) -> None:
    k8s.CustomObjectsApi(api).patch_namespaced_custom_object("diloco.dev", "v1alpha1", ns, "dilocojobs", JOB,
                                                             {"spec": spec})  # fmt: skip
