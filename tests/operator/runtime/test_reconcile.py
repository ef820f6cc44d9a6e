"""One reconcile of a job's children against an in-memory apiserver: what is validated before
anything is deleted, and what counts as drift."""

from __future__ import annotations

import base64
import copy
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from diloco_operator.builders.children import build_children
from diloco_operator.builders.names import JobRef
from diloco_operator.kube import Kube
from diloco_operator.runtime.reconcile import reconcile_children, validation_sample
from diloco_operator.schema.spec import DiLoCoJobSpec, SpecError, parse_spec
from kubernetes.client.exceptions import ApiException

JOB = JobRef("job", "ns", "uid-1")
Key = tuple[str, str, str]


def raw(**extra: Any) -> dict[str, Any]:
    return {
        "images": {"worker": "w:1", "synchronizer": "s:1"},
        "storage": {"bucket": "bkt", "prefix": "jobs/x"},
        "learnerUnits": [{"name": "a", "replicas": 1}],
        **extra,
    }


class MemoryKube(Kube):
    """An apiserver in memory, for what a unit test cannot get from the builders alone: a dry run
    that the apiserver refuses (``refuse``: which objects) and the canonical form the apiserver
    stores (``canonical``: the stored object from the applied one). Objects are keyed by
    (kind, namespace, name); a LIST selects by label equality."""

    def __init__(
        self,
        refuse: Callable[[Mapping[str, Any]], bool] = lambda obj: False,
        canonical: Callable[[dict[str, Any]], dict[str, Any]] = lambda obj: obj,
    ) -> None:
        self.store: dict[Key, dict[str, Any]] = {}
        self.refuse = refuse
        self.canonical = canonical
        self.writes: list[tuple[str, str, str]] = []  # (verb, kind, name)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.store.get((kind, namespace, name)))

    def list(
        self, api_version: str, kind: str, namespace: str, selector: Mapping[str, str]
    ) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(obj)
            for (k, ns, _), obj in self.store.items()
            if k == kind
            and ns == namespace
            and all((obj["metadata"].get("labels") or {}).get(a) == b for a, b in selector.items())
        ]

    def apply(self, obj: Mapping[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        meta = obj["metadata"]
        if dry_run:
            self.writes.append(("dry-run", obj["kind"], meta["name"]))
            if self.refuse(obj):
                raise ApiException(status=422, reason="Invalid")
            return dict(obj)
        self.writes.append(("apply", obj["kind"], meta["name"]))
        stored = self.canonical(copy.deepcopy(dict(obj)))
        if "stringData" in stored:
            stored["data"] = {
                k: base64.b64encode(v.encode()).decode() for k, v in stored.pop("stringData").items()
            }
        self.store[(obj["kind"], meta["namespace"], meta["name"])] = stored
        return copy.deepcopy(stored)

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        if (obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]) in self.store:
            return None
        return self.apply(obj)

    def delete(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        *,
        grace: int | None = None,
        uid: str | None = None,
    ) -> bool:
        self.writes.append(("delete", kind, name))
        return self.store.pop((kind, namespace, name), None) is not None


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as executor:
        yield executor


def reconcile(
    kube: MemoryKube, spec: DiLoCoJobSpec, pool: ThreadPoolExecutor, *, validate: bool
) -> tuple[int, int]:
    outcome, _ = reconcile_children(
        kube, JOB, spec, validate=validate, learners_stopped=False, down={}, pool=pool
    )
    return outcome.created, outcome.repaired


def misspelt_toleration(obj: Mapping[str, Any]) -> bool:
    pod = obj["spec"]["template"]["spec"]
    return any(t.get("operator") == "Exsts" for t in pod.get("tolerations") or [])


def test_a_refused_edit_under_a_queue_deletes_no_unit(pool: ThreadPoolExecutor) -> None:
    """A new size (which Kueue makes anew: delete, create) in the same edit as a toleration the
    apiserver refuses: the dry run refuses the edit before the running unit is deleted."""
    kube = MemoryKube(refuse=misspelt_toleration)
    reconcile(kube, parse_spec(raw(queueName="q")), pool, validate=True)
    edit = raw(
        queueName="q",
        learnerUnits=[{"name": "a", "replicas": 2, "tolerations": [{"key": "x", "operator": "Exsts"}]}],
    )
    kube.writes.clear()

    with pytest.raises(SpecError, match="the spec makes an invalid StatefulSet job-a"):
        reconcile(kube, parse_spec(edit), pool, validate=True)

    assert kube.store[("StatefulSet", "ns", "job-a")]["spec"]["replicas"] == 1
    assert [w for w in kube.writes if w[0] != "dry-run"] == []


def test_a_queue_locked_unit_is_validated_scaled_to_zero_then_made_anew(pool: ThreadPoolExecutor) -> None:
    """The dry run of a unit Kueue would not let change in place is one Kueue admits (scaled to
    zero, the same pod template); once every child passed, the unit is deleted and created anew."""
    kube = MemoryKube()
    reconcile(kube, parse_spec(raw(queueName="q")), pool, validate=True)
    kube.writes.clear()
    dry_runs: list[tuple[str, int]] = []

    def record(obj: Mapping[str, Any]) -> bool:
        dry_runs.append((obj["kind"], obj["spec"]["replicas"]))
        return False

    kube.refuse = record
    resized = parse_spec(raw(queueName="q", learnerUnits=[{"name": "a", "replicas": 2}]))
    reconcile(kube, resized, pool, validate=True)

    assert ("StatefulSet", 0) in dry_runs
    sts = [w for w in kube.writes if w[1] == "StatefulSet"]
    assert sts == [
        ("dry-run", "StatefulSet", "job-a"),
        ("delete", "StatefulSet", "job-a"),
        ("apply", "StatefulSet", "job-a"),
    ]
    assert kube.store[("StatefulSet", "ns", "job-a")]["spec"]["replicas"] == 2


CANONICAL = {"0.5": "500m", "1.5Gi": "1536Mi", 1073741824: "1Gi"}


def canonical_quantities(obj: dict[str, Any]) -> dict[str, Any]:
    """Resource quantities as the apiserver stores them."""
    if obj["kind"] in ("StatefulSet", "Deployment"):
        for container in obj["spec"]["template"]["spec"]["containers"]:
            for part in (container.get("resources") or {}).values():
                for k, v in part.items():
                    part[k] = CANONICAL.get(v, v)
    return obj


def test_quantities_the_apiserver_rewrites_are_no_drift(pool: ThreadPoolExecutor) -> None:
    resources = {"requests": {"cpu": "0.5", "memory": "1.5Gi"}, "limits": {"memory": 1073741824}}
    spec = parse_spec(raw(learnerUnits=[{"name": "a", "resources": resources}]))
    kube = MemoryKube(canonical=canonical_quantities)
    created, _ = reconcile(kube, spec, pool, validate=False)
    stored = kube.store[("StatefulSet", "ns", "job-a")]["spec"]["template"]["spec"]["containers"][0][
        "resources"
    ]
    assert created > 0
    assert stored["requests"] == {"cpu": "500m", "memory": "1536Mi"}

    assert reconcile(kube, spec, pool, validate=False) == (0, 0)

    more = parse_spec(raw(learnerUnits=[{"name": "a", "resources": {**resources, "requests": {"cpu": "1"}}}]))
    assert reconcile(kube, more, pool, validate=False) == (0, 1)


@pytest.mark.parametrize("source", ["my-secret", None])
def test_the_validation_sample_takes_volumes_as_written(source: Any) -> None:
    """Children built from a spec that bypassed the spec's checks (a volume source that is no
    object) are still sampled, not a crash: the apiserver's dry run then says what is wrong."""
    spec = parse_spec(raw())
    children = build_children(JOB, spec)
    for obj in children:
        if obj["kind"] == "StatefulSet":
            obj["spec"]["template"]["spec"]["volumes"].append({"name": "creds", "secret": source})
    assert [o["kind"] for o in validation_sample(children)] == ["Deployment", "StatefulSet"]
