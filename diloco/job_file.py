"""One job description for every command: the ``DiLoCoJob`` manifest that ``kubectl apply`` takes.

``diloco run -f job.yaml`` runs it locally (``diloco.runner.job_file``); ``diloco worker -f job.yaml``
and ``diloco synchronizer -f job.yaml`` take from it the job configuration the operator would write
into the job's ConfigMap (``diloco_operator.builders.build_job_config``: the same settings, the same
defaults), so no setting is repeated by hand on any command line. The manifest is parsed and checked
by the operator's own model: a manifest the operator would refuse is refused with the same message.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from diloco_core.flags import SettingsError
from diloco_operator.builders.config import build_job_config
from diloco_operator.builders.names import JobRef, job_id
from diloco_operator.schema.spec import DiLoCoJobSpec, SpecError, parse_spec, validate_job

KIND = "DiLoCoJob"
FILE_OPTIONS = ("-f", "--file")


@dataclass(frozen=True)
class Manifest:
    """A parsed manifest: the job's name, its spec, and the spec as written (which fields it sets)."""

    name: str
    spec: DiLoCoJobSpec
    raw: dict[str, Any]

    @property
    def ref(self) -> JobRef:
        """The job as the operator's builders name it (no namespace or uid outside a cluster)."""
        return JobRef(self.name, "", "")

    @property
    def job_id(self) -> str:
        """The training job's id (``diloco_operator.builders.job_id``: its name, or the external job's)."""
        found: str = job_id(self.ref, self.spec)
        return found


def read_manifest(path: Path) -> Manifest:
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SettingsError(f"-f {path}: cannot read it: {exc}") from None
    return parse_manifest(doc, str(path))


def parse_manifest(doc: Any, source: str) -> Manifest:
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise SettingsError(f"-f {source}: not a {KIND} manifest (kind: {KIND}, with a spec)")
    name = str((doc.get("metadata") or {}).get("name") or "job")
    raw = doc.get("spec")
    if not isinstance(raw, dict):
        raise SettingsError(f"-f {source}: the manifest has no spec")
    try:
        spec = parse_spec(raw)
        validate_job(name, spec)
    except SpecError as exc:
        raise SettingsError(f"-f {source}: {exc}") from None
    return Manifest(name, spec, raw)


def _split_file_option(argv: Sequence[str]) -> tuple[Path | None, list[str]]:
    """The ``-f FILE`` / ``--file FILE`` / ``--file=FILE`` of ``argv``, and the other arguments."""
    rest: list[str] = []
    path: Path | None = None
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in FILE_OPTIONS:
            if i + 1 >= len(args):
                raise SettingsError(f"{arg} needs a file: {arg} job.yaml")
            path, i = Path(args[i + 1]), i + 2
            continue
        if arg.startswith("--file="):
            path = Path(arg.removeprefix("--file="))
        else:
            rest.append(arg)
        i += 1
    return path, rest


def _option(argv: Sequence[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def setting_flags(
    settings: Mapping[str, object], given: Sequence[str] = (), environ: Mapping[str, str] | None = None
) -> list[str]:
    """``--name value`` for each setting (``round_memory_bytes`` -> ``--round-memory-bytes``), except
    those whose flag is in ``given`` or whose ``DILOCO_`` variable is in ``environ`` (either wins)."""
    env = environ or {}
    kept = {name: value for name, value in settings.items() if f"DILOCO_{name.upper()}" not in env}
    flags = ((f"--{name.replace('_', '-')}", value) for name, value in kept.items())
    return [arg for flag, value in flags if _option(given, flag) is None for arg in (flag, str(value))]


def component_argv(
    component: str, argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> list[str]:
    """``argv`` of ``diloco worker`` or ``diloco synchronizer`` with ``-f job.yaml`` turned into the
    manifest's job configuration (``--job-config``) and, for a learner, its unit's batch size and data
    shard (the unit named by ``--unit``, needed when the units' batch sizes differ); for the synchronizer, the job's
    memory budgets and storage unless their flags (or, for the budgets, their ``DILOCO_*``
    variables in ``environ``, the process's by default) are given. Without ``-f``, ``argv`` as it is."""
    path, rest = _split_file_option(argv)
    if path is None:
        return list(argv)
    if _option(rest, "--job-config") is not None:
        raise SettingsError(f"-f {path} and --job-config both given: one of them")
    manifest = read_manifest(path)
    spec = manifest.spec
    config = build_job_config(manifest.ref, spec)
    out = ["--job-config", json.dumps(config.model_dump(mode="json"))]
    if component == "worker":
        unit_name = _option(rest, "--unit")
        units = {u.name: u for u in spec.learner_units}
        if unit_name is not None and unit_name not in units:
            raise SettingsError(f"-f {path}: no learner unit {unit_name!r} (units: {', '.join(units)})")
        sizes = {u.batch_size for u in spec.learner_units}
        if unit_name is None and len(sizes) > 1:
            raise SettingsError(
                f"-f {path}: the units' batch sizes differ ({', '.join(f'{u.name}={u.batch_size}' for u in units.values())}): "
                "name this learner's unit with --unit"
            )
        batch = units[unit_name].batch_size if unit_name else sizes.pop()
        if _option(rest, "--batch-size") is None:
            out += ["--batch-size", str(batch)]
        if unit_name is not None and _option(rest, "--learner-index") is None:  # its unit's data shard
            out += ["--learner-index", str(list(units).index(unit_name)), "--num-learners", str(len(units))]
    if component == "synchronizer":  # its memory budgets, as the operator gives them to its pod
        env = os.environ if environ is None else environ
        out += setting_flags(spec.synchronizer.memory_budgets.settings(), rest, env)
    if component == "synchronizer" and _option(rest, "--storage") is None:
        out += ["--storage", spec.storage.url]
        if spec.storage.endpoint and _option(rest, "--storage-endpoint-url") is None:
            out += ["--storage-endpoint-url", spec.storage.endpoint]
        if spec.storage.region and _option(rest, "--storage-region") is None:
            out += ["--storage-region", spec.storage.region]
    return out + rest
