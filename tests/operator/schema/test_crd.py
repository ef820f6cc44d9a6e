"""The CRD (crds/, the source of truth): structure, documentation, examples, the typed model, and
the core's settings (every one a field of the CRD, or listed with a reason)."""

from __future__ import annotations

import copy
import functools
import typing
from pathlib import Path
from typing import Any

import annotated_types
import jsonschema
import pytest
import yaml
from diloco_core.config import (
    ENTRY_POINT_PATTERN,
    DataSettings,
    DiLoCoSettings,
    JobConfig,
    ModelSettings,
    StorageSettings,
    TrainSettings,
)
from diloco_operator.schema.quantity import QUANTITY_PATTERN
from diloco_operator.schema.spec import (
    NO_CRD_FIELD,
    DiLoCoJobSpec,
    LearnerUnit,
    SpecError,
    crd_name,
    parse_spec,
    validate_job,
)
from pydantic import BaseModel
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parents[3]
CRD_PATH = ROOT / "crds" / "dilocojobs.diloco.dev.yaml"


@functools.cache
def _parsed_crd() -> dict[str, Any]:
    return dict(yaml.safe_load(CRD_PATH.read_text()))


def crd() -> dict[str, Any]:
    """The CRD as a fresh copy (parsed once: the tests walk it for every setting)."""
    return copy.deepcopy(_parsed_crd())


def version() -> dict[str, Any]:
    (v,) = crd()["spec"]["versions"]
    return dict(v)


def schema() -> dict[str, Any]:
    return dict(version()["schema"]["openAPIV3Schema"])


def example_docs() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        docs += [
            (f"{path.name}:{d['metadata']['name']}", d) for d in yaml.safe_load_all(path.read_text()) if d
        ]
    return docs


def walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for name, child in (node.get("properties") or {}).items():
        out += walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        out += walk(node["items"], f"{path}[]")
    return out


def test_identity_short_name_and_subresources() -> None:
    c = crd()
    assert c["metadata"]["name"] == "dilocojobs.diloco.dev"
    assert c["spec"]["group"] == "diloco.dev"
    assert c["spec"]["names"]["kind"] == "DiLoCoJob"
    assert "dj" in c["spec"]["names"]["shortNames"]
    v = version()
    assert v["name"] == "v1alpha1"
    assert v["subresources"] == {"status": {}}
    columns = {col["name"]: col["jsonPath"] for col in v["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase"
    assert columns["Units"] == ".status.unitsReady"
    assert {"Version", "Rounds", "Tokens", "Age"} <= set(columns)


def test_every_field_is_described() -> None:
    missing = [p for p, node in walk(schema()) if p and p != ".metadata" and not node.get("description")]
    assert missing == []


def test_schema_is_structural() -> None:
    """Every node has a type (or preserves unknown fields / is int-or-string)."""
    untyped = [
        p
        for p, node in walk(schema())
        if "type" not in node
        and not node.get("x-kubernetes-int-or-string")
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ]
    assert untyped == []


@pytest.mark.parametrize(("name", "doc"), example_docs(), ids=[n for n, _ in example_docs()])
def test_examples_validate_against_the_schema(name: str, doc: dict[str, Any]) -> None:
    jsonschema.Draft4Validator(schema()).validate(doc)
    spec = parse_spec(doc["spec"])
    validate_job(doc["metadata"]["name"], spec)


def test_schema_rejects_bad_enum_and_range() -> None:
    _, doc = example_docs()[0]
    bad = yaml.safe_load(yaml.safe_dump(doc))
    bad["spec"]["diloco"]["codec"] = "int3"
    with pytest.raises(jsonschema.ValidationError, match="int3"):
        jsonschema.Draft4Validator(schema()).validate(bad)
    bad["spec"]["diloco"]["codec"] = "int8"
    bad["spec"]["learnerUnits"][0]["replicas"] = -1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(schema()).validate(bad)


def test_cel_rules_cover_overlap_quorum_and_budget() -> None:
    rules = {r["rule"] for r in schema()["properties"]["spec"]["x-kubernetes-validations"]}
    assert "self.diloco.overlap < self.diloco.innerSteps" in rules
    # a unit of replicas 0 is never ready: it does not count toward the quorum (validate_job alike)
    assert (
        "self.diloco.quorum <= size(self.learnerUnits.filter(u, !has(u.replicas) || u.replicas > 0))" in rules
    )
    # a unit named like a synchronizer shard's Service (validate_job: sync_unit_names)
    (names,) = [r for r in rules if "'sync'" in r]
    assert names.startswith("has(self.synchronizer.external) || ")
    assert "u.name != 'sync'" in names
    assert "int(u.name.substring(5)) < self.synchronizer.shards" in names
    units = schema()["properties"]["spec"]["properties"]["learnerUnits"]
    assert units["x-kubernetes-list-type"] == "map"  # the apiserver rejects duplicate unit names


def compare_model(model: type[BaseModel], node: dict[str, Any], path: str, problems: list[str]) -> None:
    """Field names (camelCase), defaults and enums of the model match the CRD's; the core's
    settings that the CRD sets elsewhere (NO_CRD_FIELD) are not fields of it."""
    props = node.get("properties") or {}
    section = path.split(".")[-1] if path != "spec" else ""
    elsewhere = {crd_name(name) for (s, name) in NO_CRD_FIELD if s == section}
    aliases = {f.alias or n: (n, f) for n, f in model.model_fields.items() if (f.alias or n) not in elsewhere}
    if set(aliases) != set(props):
        problems.append(f"{path}: model {sorted(aliases)} vs CRD {sorted(props)}")
    for alias, (_, field) in aliases.items():
        sub = props.get(alias)
        if sub is None:
            continue
        ann = field.annotation
        inner = typing.get_args(ann)[0] if typing.get_origin(ann) is list else None
        optional = [a for a in typing.get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
        if optional and typing.get_origin(ann) is not list:
            ann = optional[0]
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            compare_model(ann, sub, f"{path}.{alias}", problems)
        elif isinstance(inner, type) and issubclass(inner, BaseModel):
            compare_model(inner, sub["items"], f"{path}.{alias}[]", problems)
        else:
            if "default" in sub and field.default != sub["default"]:
                problems.append(f"{path}.{alias}: default {field.default!r} vs CRD {sub['default']!r}")
            if typing.get_origin(ann) is typing.Literal and list(typing.get_args(ann)) != sub.get("enum"):
                problems.append(
                    f"{path}.{alias}: values {typing.get_args(ann)} vs CRD enum {sub.get('enum')}"
                )


def test_model_matches_the_crd() -> None:
    problems: list[str] = []
    compare_model(DiLoCoJobSpec, schema()["properties"]["spec"], "spec", problems)
    assert problems == []


# the core's settings: JobConfig's own fields ("") and sections, and the storage settings
CORE_SECTIONS: dict[str, type[BaseModel]] = {
    "": JobConfig, "diloco": DiLoCoSettings, "model": ModelSettings, "train": TrainSettings,
    "data": DataSettings, "storage": StorageSettings,
}  # fmt: skip


def crd_section(section: str) -> dict[str, Any]:
    spec = schema()["properties"]["spec"]
    props: dict[str, Any] = spec["properties"] if not section else spec["properties"][section]["properties"]
    return props


def core_settings() -> list[tuple[str, str, FieldInfo]]:
    return [
        (section, name, info)
        for section, cls in CORE_SECTIONS.items()
        for name, info in cls.model_fields.items()
        if not (isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel))
    ]


def test_every_core_setting_has_a_crd_field_or_a_documented_reason() -> None:
    """A setting added to diloco_core.config must reach Kubernetes users too (additively), or say why not."""
    missing = [
        f"{section or 'job'}.{name}"
        for section, name, _ in core_settings()
        if crd_name(name) not in crd_section(section) and (section, name) not in NO_CRD_FIELD
    ]
    assert (
        missing == []
    ), "add a CRD field (crds/, then scripts/sync-chart-crd.sh) or a reason to NO_CRD_FIELD"
    stale = [key for key in NO_CRD_FIELD if crd_name(key[1]) in crd_section(key[0])]
    assert stale == [], "these settings have a CRD field now: remove them from NO_CRD_FIELD"
    assert all(reason for reason in NO_CRD_FIELD.values())


def bounds(info: FieldInfo) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in info.metadata:
        if isinstance(m, annotated_types.Ge | annotated_types.Gt):
            out["min"], out["min_excl"] = (
                float(getattr(m, "ge", getattr(m, "gt", 0))),
                float(isinstance(m, annotated_types.Gt)),
            )
        if isinstance(m, annotated_types.Le | annotated_types.Lt):
            out["max"], out["max_excl"] = (
                float(getattr(m, "le", getattr(m, "lt", 0))),
                float(isinstance(m, annotated_types.Lt)),
            )
    return out


def crd_bounds(node: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    if "minimum" in node:
        out["min"], out["min_excl"] = float(node["minimum"]), float(bool(node.get("exclusiveMinimum")))
    if "maximum" in node:
        out["max"], out["max_excl"] = float(node["maximum"]), float(bool(node.get("exclusiveMaximum")))
    return out


def test_the_crd_checks_the_ranges_the_core_settings_declare() -> None:
    """The apiserver refuses what the settings would refuse; the CRD may only add a bound (a maximum
    the core leaves open, such as fragments <= 1024)."""
    problems = []
    for section, name, info in core_settings():
        node = crd_section(section).get(crd_name(name))
        if node is None:
            continue
        core, crd_ = bounds(info), crd_bounds(node)
        if any(crd_.get(k) != v for k, v in core.items()):
            problems.append(f"{section}.{name}: core {core} vs CRD {crd_}")
    assert problems == []


def test_a_units_batch_size_defaults_to_the_core_setting() -> None:
    assert LearnerUnit.model_fields["batch_size"].default == TrainSettings.model_fields["batch_size"].default


def patterns(info: FieldInfo) -> list[str]:
    return [p for m in info.metadata if (p := getattr(m, "pattern", None))]


def test_the_crd_checks_the_patterns_the_core_settings_declare() -> None:
    problems = [
        f"{section}.{name}"
        for section, name, info in core_settings()
        if (node := crd_section(section).get(crd_name(name))) is not None
        and patterns(info)
        and node.get("pattern") != patterns(info)[0]
    ]
    assert problems == []
    assert crd_section("model")["entryPoint"]["pattern"] == ENTRY_POINT_PATTERN


def quantity_nodes() -> list[tuple[str, dict[str, Any]]]:
    return [
        (path, node)
        for path, node in walk(schema())
        if path.endswith(("resources.requests", "resources.limits"))
    ]


def test_every_resource_quantity_is_checked_at_admission() -> None:
    nodes = quantity_nodes()
    assert len(nodes) == 6  # learner units', the synchronizer's and the export pod's requests and limits
    for _, node in nodes:
        value = node["additionalProperties"]
        assert value["x-kubernetes-int-or-string"] is True
        assert value["pattern"] == QUANTITY_PATTERN


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("500m", True),
        ("2", True),
        ("16Gi", True),
        ("1.5", True),
        ("1e3", True),
        ("+1", True),
        (8, True),
        ("lots", False),
        ("-1", False),
        ("2 Gi", False),
        ("", False),
        ("1.5.2", False),
        ("Gi", False),
    ],
)
def test_quantities(value: Any, ok: bool) -> None:
    base = {"images": {"worker": "w", "synchronizer": "s"}, "storage": {"bucket": "bkt"}}
    doc = {**base, "learnerUnits": [{"name": "a", "resources": {"requests": {"cpu": value}}}]}
    if ok:
        parse_spec(doc)
    else:
        with pytest.raises(SpecError, match="is not a quantity"):
            parse_spec(doc)
    schema_ok = not list(jsonschema.Draft4Validator(quantity_nodes()[0][1]).iter_errors({"cpu": value}))
    assert schema_ok is ok


@pytest.mark.parametrize("entry", ["builtin", "user_model:build", "pkg.sub_2.mod:make_task"])
def test_entry_points_that_can_work(entry: str) -> None:
    base = {
        "images": {"worker": "w", "synchronizer": "s"},
        "storage": {"bucket": "bkt"},
        "learnerUnits": [{"name": "a"}],
    }
    assert parse_spec({**base, "model": {"entryPoint": entry}}).model.entry_point == entry
