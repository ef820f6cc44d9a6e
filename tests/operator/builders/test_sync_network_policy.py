"""The NetworkPolicy that guards a job's synchronizer pods, as ``build_children`` makes it."""

from __future__ import annotations

from diloco_operator.builders.children import build_children
from diloco_operator.builders.names import JobRef
from diloco_operator.builders.network import SyncIngress

from tests.operator.builders.test_children import JOB, by_kind, example


def test_the_synchronizer_admits_only_its_learners_and_the_operators_namespace() -> None:
    _, spec = example("single-region.yaml")
    children = build_children(JOB, spec, ingress=SyncIngress("diloco-system"))
    (policy,) = by_kind(children, "NetworkPolicy")
    assert policy["metadata"]["namespace"] == JOB.namespace
    assert policy["metadata"]["ownerReferences"][0]["uid"] == JOB.uid
    assert policy["spec"]["podSelector"]["matchLabels"] == {
        "diloco.dev/job": JOB.name,
        "app.kubernetes.io/component": "synchronizer",
    }
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8080}]
    assert rule["from"] == [
        {
            "podSelector": {
                "matchLabels": {"diloco.dev/job": JOB.name, "app.kubernetes.io/component": "learner"}
            }
        },
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "diloco-system"}}},
    ]
    learner = by_kind(children, "StatefulSet")[0]["spec"]["template"]["metadata"]["labels"]
    sync = by_kind(children, "Deployment")[0]["spec"]["template"]["metadata"]["labels"]
    assert rule["from"][0]["podSelector"]["matchLabels"].items() <= learner.items()
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= sync.items()
    kinds = [c["kind"] for c in children]
    assert kinds.index("NetworkPolicy") < kinds.index("Deployment")  # pods start guarded


def test_no_policy_when_turned_off_or_the_synchronizer_is_external() -> None:
    _, spec = example("single-region.yaml")
    assert by_kind(build_children(JOB, spec, ingress=None), "NetworkPolicy") == []
    name, external = example("multi-region.yaml", 1)
    assert by_kind(build_children(JobRef(name, "research", JOB.uid), external), "NetworkPolicy") == []
