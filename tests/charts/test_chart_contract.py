"""The chart against the code it deploys: the operator's flags, settings and defaults, and the labels,
port and Service of the synchronizers the operator creates. The operator's own parsers read what the
chart renders, so a renamed flag or variable fails here rather than in a crash-looping pod."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from diloco_operator.builders import env, learners, names, synchronizer
from diloco_operator.cli import parse_args
from diloco_operator.schema.spec import parse_spec
from diloco_operator.settings import OperatorSettings, settings_from_env

from tests.charts.helm import CHART, Manifest, of_kind, one, render
from tests.charts.test_chart_render import CUSTOM_VALUES

DEFAULTS: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())


def _container(manifests: list[Manifest]) -> dict[str, Any]:
    (container,) = one(manifests, "Deployment")["spec"]["template"]["spec"]["containers"]
    return dict(container)


def _ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def test_chart_defaults_are_the_operators_own_defaults() -> None:
    bare = parse_args([])
    assert urlsplit(bare.liveness).port == DEFAULTS["operator"]["healthPort"]
    assert urlsplit(bare.liveness).path == "/healthz"
    settings = OperatorSettings()
    assert settings.metrics_port == DEFAULTS["operator"]["metricsPort"]
    assert settings.resync_seconds == DEFAULTS["operator"]["resyncSeconds"]
    assert settings.status_timeout_seconds == DEFAULTS["operator"]["statusTimeoutSeconds"]
    assert settings.allow_chaos is DEFAULTS["operator"]["allowChaos"] is False
    assert bare.priority == DEFAULTS["peering"]["priority"]
    assert bare.peering == DEFAULTS["peering"]["name"] == "diloco"


@pytest.mark.parametrize("values", [None, CUSTOM_VALUES], ids=["defaults", "custom"])
def test_operator_parses_the_rendered_arguments_and_environment(
    tmp_path: Path, values: dict[str, Any] | None
) -> None:
    manifests = render(tmp_path, values)
    container = _container(manifests)
    assert container["command"] == ["diloco", "operator"]
    args = parse_args(container["args"])
    assert sorted(args.namespace) == sorted((values or {}).get("watchNamespaces", []))
    assert not args.standalone
    # the chart's operator joins the peering that one started by hand joins by default
    assert args.peering == ((values or {}).get("peering", {}).get("name") or OperatorSettings().peering)
    assert not of_kind(manifests, "KopfPeering") + of_kind(manifests, "ClusterKopfPeering")
    assert urlsplit(args.liveness).port == _ports(container)["health"]
    assert container["livenessProbe"]["httpGet"]["path"] == urlsplit(args.liveness).path
    variables = {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("DILOCO_OPERATOR_")}
    settings = settings_from_env(variables)
    assert settings.metrics_port == _ports(container)["metrics"]
    assert settings.resync_seconds == ((values or DEFAULTS)["operator"]["resyncSeconds"])
    assert settings.allow_chaos is (values or DEFAULTS)["operator"].get("allowChaos", False)


def test_peering_can_be_turned_off_for_a_standalone_operator(tmp_path: Path) -> None:
    manifests = render(tmp_path, {"peering": {"enabled": False}})
    assert parse_args(_container(manifests)["args"]).standalone
    assert of_kind(manifests, "ClusterKopfPeering") == []


def test_network_policy_and_service_monitor_select_what_the_operator_creates(tmp_path: Path) -> None:
    job = names.JobRef(name="j", namespace="team-a", uid="u")
    service = synchronizer.build_sync_service(job, 0)
    sync_labels = names.labels(job.name, synchronizer.COMPONENT)
    learner_labels = names.labels(job.name, learners.COMPONENT)
    assert DEFAULTS["podLabels"]["synchronizer"].items() <= sync_labels.items()
    assert DEFAULTS["podLabels"]["synchronizer"].items() <= service["metadata"]["labels"].items()
    assert DEFAULTS["podLabels"]["learner"].items() <= learner_labels.items()
    assert DEFAULTS["networkPolicy"]["synchronizerPort"] == env.SYNC_PORT

    values = {"metrics": {"serviceMonitor": {"enabled": True}}}
    manifests = render(tmp_path, values, extra=("--api-versions", "monitoring.coreos.com/v1/ServiceMonitor"))
    monitor = next(
        m for m in of_kind(manifests, "ServiceMonitor") if m["metadata"]["name"].endswith("-synchronizers")
    )
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    # a plain synchronizer's port and one serving HTTPS (spec.synchronizer.tls) are both scraped
    tls_spec = parse_spec({"images": {"worker": "w", "synchronizer": "s"}, "storage": {"bucket": "bkt"},
                           "learnerUnits": [{"name": "a"}], "synchronizer": {"tls": {"secretName": "c"}}})  # fmt: skip
    tls_service = synchronizer.build_sync_service(job, 0, names.sync_port_name(tls_spec))
    endpoints = {e["port"]: e for e in monitor["spec"]["endpoints"]}
    assert set(endpoints) == {p["name"] for s in (service, tls_service) for p in s["spec"]["ports"]}
    assert endpoints["https"]["scheme"] == "https"
    assert endpoints["http"].get("scheme", "http") == "http"


def test_chaos_is_allowed_only_when_the_chart_says_so(tmp_path: Path) -> None:
    container = _container(render(tmp_path, {"operator": {"allowChaos": True}}))
    variables = {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("DILOCO_OPERATOR_")}
    assert variables["DILOCO_OPERATOR_ALLOW_CHAOS"] == "true"
    assert settings_from_env(variables).allow_chaos is True
