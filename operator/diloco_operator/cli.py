"""``diloco operator``: run the DiLoCoJob operator (kopf) against the cluster in the kubeconfig.

Two replicas never fight: kopf peering (``ClusterKopfPeering``, or ``KopfPeering`` with
``--namespace``, CRDs in crds/kopfpeerings.kopf.dev.yaml, the object in operator/peering.yaml)
lets only the replica with the highest priority handle jobs; the others pause.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

import kopf

from diloco_operator.settings import settings_from_env


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="diloco operator", description=__doc__.splitlines()[0])
    p.add_argument("--namespace", "-n", action="append", default=[],
                   help="watch only this namespace (repeatable); default: all namespaces")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                   help="liveness endpoint URL ('' disables)")
    p.add_argument("--peering", default="diloco-operator", help="name of the kopf peering object")
    p.add_argument("--priority", type=int, default=0, help="peering priority of this replica")
    p.add_argument("--standalone", action="store_true", help="no peering: for a single replica or tests")
    p.add_argument("--allow-chaos", action="store_true",
                   help="let jobs with spec.chaos.enabled kill their learner pods (also DILOCO_OPERATOR_ALLOW_CHAOS)")
    p.add_argument("--verbose", "-v", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    patterns = [ns for ns in args.namespace if any(c in ns for c in "*?[]!")]
    if patterns:
        print(f"diloco operator: --namespace takes namespace names, not patterns: {', '.join(patterns)}")
        return 2
    if args.allow_chaos:
        os.environ["DILOCO_OPERATOR_ALLOW_CHAOS"] = "true"  # read with the other settings
    try:
        settings_from_env()  # fail now, with the variable's name, rather than inside kopf
    except ValueError as exc:
        print(f"diloco operator: {exc}")
        return 2
    import diloco_operator.handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=args.verbose)
    logging.getLogger("diloco_operator").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    # kopf's own id for this replica, kept in the memo so liveness can tell itself from its peers
    from kopf._core.engines.peering import detect_own_id

    identity = detect_own_id(manual=False)
    asyncio.run(kopf.operator(
        identity=identity,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness or None,
        peering_name=None if args.standalone else args.peering,
        standalone=args.standalone,
        priority=args.priority,
        memo=kopf.Memo(namespaces=list(args.namespace), identity=str(identity)),  # for liveness
    ))
    return 0
