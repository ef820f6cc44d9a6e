"""The Grafana dashboard shipped with the chart: valid JSON, the panels operators need, and queries that
read only metrics and labels the synchronizer and the operator really export."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import pytest
from diloco_operator.runtime.metrics import OperatorMetrics
from diloco_sync.metrics import Metrics
from prometheus_client.metrics import MetricWrapperBase

from tests.charts.helm import CHART

DASHBOARD = CHART / "dashboards" / "diloco.json"
# labels Prometheus adds to every series it scrapes through a ServiceMonitor
SCRAPE_LABELS = frozenset({"namespace", "service", "pod", "container", "endpoint", "instance", "job"})
# the series a metric of each type exports, by suffix
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


@dataclass(frozen=True)
class Exported:
    kind: str
    labels: frozenset[str]


def _exported() -> dict[str, Exported]:
    """Every series name the synchronizer's and the operator's registries export, with its metric's
    type and labels (read from the metric objects: an unobserved labelled metric has no samples)."""
    out: dict[str, Exported] = {}
    for owner in (Metrics(), OperatorMetrics()):
        for metric in vars(owner).values():
            if not isinstance(metric, MetricWrapperBase):
                continue
            (family,) = metric.collect()
            found = Exported(family.type, frozenset(metric._labelnames))  # no public accessor
            for suffix in SUFFIXES[family.type]:
                out[family.name + suffix] = found
    return out


def _queries() -> list[tuple[str, str, str]]:
    """(where, PromQL expression, legend) of every panel target and templating query."""
    dashboard = json.loads(DASHBOARD.read_text())
    found = [
        (f"panel {p['title']!r}", t["expr"], t.get("legendFormat", ""))
        for p in dashboard["panels"]
        for t in p.get("targets", [])
    ]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found.append((f"variable {variable['name']!r}", variable["query"]["query"], ""))
    return found


def _metric_names(expression: str) -> set[str]:
    return set(re.findall(r"\bdiloco_[a-z_]+\b", expression))


def test_dashboard_has_the_panels_operators_need() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    wanted = (
        "Participation", "Goodput", "Rounds/s", "Bytes on the wire", "Contributions", "Jobs by phase",
        "Contribution staleness", "Held-out loss per learner", "Tokens/s per learner",
    )  # fmt: skip
    assert set(wanted) <= titles
    assert dashboard["uid"] == "diloco-overview"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "namespace", "job"}
    for panel in dashboard["panels"]:
        assert panel["type"] == "row" or panel["targets"], f"panel {panel['title']!r} has no query"


@pytest.mark.parametrize(("where", "expression", "legend"), _queries(), ids=lambda v: str(v)[:40])
def test_every_query_reads_exported_metrics_with_their_labels(
    where: str, expression: str, legend: str
) -> None:
    exported = _exported()
    names = _metric_names(expression)
    assert names, f"{where}: {expression} reads no diloco metric"
    missing = names - set(exported)
    assert not missing, f"{where}: {sorted(missing)} exported by neither the synchronizer nor the operator"
    known: set[str] = set(SCRAPE_LABELS).union(*(exported[n].labels for n in names))
    if any(exported[n].kind == "histogram" for n in names):
        known.add("le")
    grouped = {
        label.strip() for clause in re.findall(r"\bby \(([^)]*)\)", expression) for label in clause.split(",")
    }
    matched = set(re.findall(r"[{,]\s*([a-z_]+)\s*=~?", expression))
    shown = set(re.findall(r"\{\{(\w+)\}\}", legend))
    unknown = (grouped | matched | shown) - known
    assert not unknown, f"{where}: labels {sorted(unknown)} are on none of {sorted(names)}"


@pytest.mark.parametrize(("where", "expression", "legend"), _queries(), ids=lambda v: str(v)[:40])
def test_counters_are_read_through_rate_and_histograms_through_their_series(
    where: str, expression: str, legend: str
) -> None:
    exported: dict[str, Any] = _exported()
    for name in _metric_names(expression):
        if exported[name].kind == "counter":
            assert re.search(rf"\b(rate|increase)\({name}\b", expression), f"{where}: {name} without rate()"
        if name.endswith("_bucket"):
            assert "histogram_quantile(" in expression, f"{where}: {name} outside histogram_quantile()"
