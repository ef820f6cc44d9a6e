"""``diloco operator``: run the DiLoCoJob operator (kopf) against the cluster in the kubeconfig.

Two replicas never fight: kopf peering (``ClusterKopfPeering``, or ``KopfPeering`` with
``--namespace``, CRDs in crds/kopfpeerings.kopf.dev.yaml, the object in operator/peering.yaml)
lets only the replica with the highest priority handle jobs; the others pause.

``--dry-run -f job.yaml`` prints the children the operator would apply for the jobs in the file,
as YAML, and needs no cluster (``diloco_operator.dry_run``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping

from diloco_core.flags import SettingsError, add_flags

from diloco_operator.settings import FLAGS, OperatorSettings, parse_settings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="diloco operator",
        description=__doc__.splitlines()[0] + " Every flag can also be set as DILOCO_OPERATOR_<FLAG>.",
    )
    add_flags(p, FLAGS)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the children of the DiLoCoJobs in -f as YAML, without a cluster, and exit",
    )
    p.add_argument("-f", "--filename", help="DiLoCoJob manifest(s) for --dry-run ('-': standard input)")
    return p


def parse_args(argv: list[str], environ: Mapping[str, str] | None = None) -> OperatorSettings:
    """The command line (and ``DILOCO_OPERATOR_*``) → settings; raises ``SettingsError``."""
    return parse_settings(build_parser().parse_args(argv), environ)


def dry_run(filename: str | None) -> int:
    import yaml

    from diloco_operator.dry_run import render_children
    from diloco_operator.schema.spec import SpecError

    if not filename:
        print("diloco operator: --dry-run needs -f FILE (a DiLoCoJob manifest, or '-')", file=sys.stderr)
        return 2
    try:
        with open(filename, encoding="utf-8") if filename != "-" else sys.stdin as f:
            documents = list(yaml.safe_load_all(f))
        print(render_children(documents), end="")
    except (OSError, yaml.YAMLError, SpecError) as exc:
        print(f"diloco operator: {filename}: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.dry_run:
        return dry_run(args.filename)
    try:
        settings = parse_settings(args)  # fail now, with the flag's or variable's name, not inside kopf
    except SettingsError as exc:
        print(f"diloco operator: {exc}")
        return 2
    patterns = [ns for ns in settings.namespace if any(c in ns for c in "*?[]!")]
    if patterns:
        print(f"diloco operator: --namespace takes namespace names, not patterns: {', '.join(patterns)}")
        return 2
    from diloco_operator.glue.app import run

    run(settings)
    return 0
