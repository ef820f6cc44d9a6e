"""`diloco bench operator`: how closely a big job's status follows its pods, on the test control plane.

A real control plane (etcd, kube-apiserver, controller-manager, scheduler and kwok, from the
project's test support; binaries from scripts/build-test-binaries.sh) with kwok nodes large enough
for the job. Per run, a fresh namespace, ``diloco operator`` as a process watching only it, and one
DiLoCoJob of ``--units`` learner units of ``--pods`` pods each. The benchmark watches the pods
itself: "reality" is the number of units whose pods are all Ready, as its own pod watch sees them,
and the baseline every figure is compared with. It also watches the job's ``status.readyUnits``.

Reported per run:

- seconds from create until reality reaches N/N, and until the status does;
- the status's lag behind reality: for each k, the time the status first showed k ready units
  minus the time reality first had k (median and maximum over k);
- how often the status went back (a smaller count after a larger one) while the job was created;
- children the operator created and restored (its metrics): more than the job's children means
  work done twice;
- after ``--deletions`` learner pods of different units are deleted at once: how long the status
  took to show the loss, and whether it showed it before reality had recovered.

``--baseline DIR`` runs the same measurement with another version of the operator (a folder that
holds a ``diloco_operator`` package, e.g. ``git archive main operator | tar -x -C /tmp/main``, then
``--baseline /tmp/main/operator``) in the same session, so the two are compared on the same
machine and load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco_bench.operator_cluster import (
    GROUP,
    JOB,
    PLURAL,
    VERSION,
    control_plane,
    job_manifest,
    scrape_children,
    wait,
)
from diloco_bench.operator_watch import JobStatus, PodReality, Timeline, Watcher, lags

if TYPE_CHECKING:
    from diloco_testbed.process import ManagedProcess


@dataclass
class RunResult:
    operator: str
    run: int
    units: int
    pods: int
    reality_ready_s: float | None
    status_ready_s: float | None
    lag_median_s: float | None
    lag_max_s: float | None
    backwards: int
    status_updates: int
    children_created: float | None
    children_restored: float | None
    loss_shown_after_s: float | None
    loss_shown_before_recovery: bool | None
    reality: list[tuple[float, int]] = field(default_factory=list, repr=False)  # the timelines (JSON only)
    status: list[tuple[float, int]] = field(default_factory=list, repr=False)


def run_once(
    plane: Any, args: argparse.Namespace, operator: str, package_dir: str | None, run: int
) -> RunResult:
    from diloco_testbed.ports import free_port
    from kubernetes import client as k8s

    ns = plane.create_namespace(f"bench-{operator}-{run}")
    metrics_port = free_port()
    proc = operator_process(plane, args, operator, package_dir, run, ns, metrics_port)
    reality, status = PodReality(args.pods), JobStatus()
    with plane.api_client() as api:
        core, custom = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
        proc.start()
        try:
            wait(lambda: "operator started" in proc.log_path.read_text(errors="replace"), 120, "the operator")
            t0 = time.monotonic()
            watchers = _start_watches(core, custom, ns, t0, reality, status)
            custom.create_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, job_manifest(args.units, args.pods)
            )
            n = args.units
            wait(
                lambda: reality.timeline.first_at_least(n) is not None
                and status.timeline.first_at_least(n) is not None,
                args.timeout,
                f"{n}/{n} units ready in reality and in the status",
                *watchers,
            )
            ready_at = max(
                reality.timeline.first_at_least(n) or 0.0, status.timeline.first_at_least(n) or 0.0
            )
            children = scrape_children(metrics_port)
            loss = _loss(core, ns, args, t0, reality.timeline, status.timeline) if args.deletions else None
            for watcher in watchers:
                watcher.stop()
            return _run_result(operator, run, args, reality.timeline, status, ready_at, children, loss)
        finally:
            proc.stop()
            plane.delete_namespace(ns)


def operator_process(
    plane: Any,
    args: argparse.Namespace,
    operator: str,
    package_dir: str | None,
    run: int,
    ns: str,
    metrics_port: int,
) -> ManagedProcess:
    """``diloco operator`` watching only ``ns``, not yet started; ``package_dir`` first on its path."""
    from diloco_testbed.process import ManagedProcess

    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_OPERATOR_")}
    env.update(
        {
            "KUBECONFIG": plane.kubeconfig,
            "DILOCO_OPERATOR_RESYNC_SECONDS": str(args.resync_seconds),
            "DILOCO_OPERATOR_METRICS_PORT": str(metrics_port),
            "DILOCO_OPERATOR_SYNC_URL": "http://127.0.0.1:9",
        }
    )
    if package_dir:
        env["PYTHONPATH"] = os.pathsep.join([package_dir, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    argv = [sys.executable, "-m", "diloco", "operator", "--standalone", f"--namespace={ns}", "--liveness="]
    return ManagedProcess(
        f"operator-{operator}", argv, Path(plane.workdir) / f"operator-{operator}-{run}.log", env=env
    )


def _start_watches(
    core: Any, custom: Any, ns: str, t0: float, reality: PodReality, status: JobStatus
) -> tuple[Watcher, Watcher]:
    """The learner pods' watch feeding ``reality`` and the job's feeding ``status``, started."""
    pods_watch = Watcher(
        core.list_namespaced_pod,
        reality.on_event,
        t0,
        ns,
        label_selector=f"diloco.dev/job={JOB},app.kubernetes.io/component=learner",
    ).start()
    job_watch = Watcher(
        custom.list_namespaced_custom_object, status.on_event, t0, GROUP, VERSION, ns, PLURAL
    ).start()
    return pods_watch, job_watch


def victims(pods: Sequence[Any], count: int) -> list[str]:
    """The first pod, by name, of each of the first ``count`` units (by their first pod's name)."""
    chosen: list[str] = []
    seen_units: set[str] = set()
    for pod in sorted(pods, key=lambda p: p.metadata.name):
        unit = pod.metadata.labels.get("diloco.dev/unit")
        if unit and unit not in seen_units and len(chosen) < count:
            seen_units.add(unit)
            chosen.append(pod.metadata.name)
    return chosen


def _loss(
    core: Any, ns: str, args: argparse.Namespace, t0: float, reality: Timeline, status: Timeline
) -> tuple[float | None, bool]:
    """Deletes ``--deletions`` learner pods of different units at once and waits for reality to lose
    and regain them: how long after reality the status showed the loss, and whether it did so before
    reality had recovered."""
    n = args.units
    pods = core.list_namespaced_pod(ns, label_selector=f"diloco.dev/job={JOB}").items
    doomed = victims(pods, args.deletions)
    t_delete = time.monotonic() - t0
    for name in doomed:
        core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
    wait(lambda: reality.first_below(n, t_delete) is not None, 60, "the loss in reality")
    wait(
        lambda: reality.first_at_least(n, reality.first_below(n, t_delete) or 0.0) is not None,
        args.timeout,
        "the units back in reality",
    )
    time.sleep(2 * args.resync_seconds + 2)  # room for a status that only moves on a timer
    dropped = reality.first_below(n, t_delete) or t_delete
    recovered = reality.first_at_least(n, dropped) or dropped
    shown = status.first_below(n, t_delete)
    return (None if shown is None else shown - dropped), (shown is not None and shown <= recovered)


def _run_result(
    operator: str,
    run: int,
    args: argparse.Namespace,
    reality: Timeline,
    status: JobStatus,
    ready_at: float,
    children: tuple[float | None, float | None],
    loss: tuple[float | None, bool] | None,
) -> RunResult:
    n = args.units
    lag = lags(reality, status.timeline, n)
    loss_after, before_recovery = loss if loss is not None else (None, None)
    return RunResult(
        operator=operator,
        run=run,
        units=n,
        pods=args.pods,
        reality_ready_s=reality.first_at_least(n),
        status_ready_s=status.timeline.first_at_least(n),
        lag_median_s=statistics.median(lag) if lag else None,
        lag_max_s=max(lag) if lag else None,
        backwards=status.timeline.backwards(ready_at),
        status_updates=status.updates,
        children_created=children[0],
        children_restored=children[1],
        loss_shown_after_s=loss_after,
        loss_shown_before_recovery=before_recovery,
        reality=[(round(t, 3), c) for t, c in reality.points],
        status=[(round(t, 3), c) for t, c in status.timeline.points],
    )


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def table(results: Sequence[RunResult]) -> str:
    head = (
        "| operator | run | reality N/N s | status N/N s | lag median / max s | went back | "
        "job updates | children created / restored | loss shown after s | before recovery |"
    )
    rows = [head, "|" + "---|" * 10]
    for r in results:
        rows.append(
            f"| {r.operator} | {r.run} | {fmt(r.reality_ready_s)} | {fmt(r.status_ready_s)} | "
            f"{fmt(r.lag_median_s)} / {fmt(r.lag_max_s)} | {r.backwards} | {r.status_updates} | "
            f"{fmt(r.children_created)} / {fmt(r.children_restored)} | {fmt(r.loss_shown_after_s)} | "
            f"{'-' if r.loss_shown_before_recovery is None else 'yes' if r.loss_shown_before_recovery else 'no'} |"
        )
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="diloco bench operator", description=__doc__.split("\n\n")[0])
    ap.add_argument("--units", type=int, default=100, help="learner units of the job")
    ap.add_argument("--pods", type=int, default=8, help="pods per learner unit")
    ap.add_argument("--runs", type=int, default=3, help="runs per operator")
    ap.add_argument(
        "--resync-seconds", type=float, default=15.0, help="the operator's resync (the chart's: 15)"
    )
    ap.add_argument(
        "--deletions", type=int, default=10, help="learner pods of different units deleted at once"
    )
    ap.add_argument(
        "--controller-manager-qps",
        type=int,
        default=0,
        help="the controller-manager's client rate (0: its default, 20/s)",
    )
    ap.add_argument("--baseline", help="a folder holding another diloco_operator package, run the same way")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take to reach N/N")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--keep-logs", action="store_true", help="keep the control plane's and operators' logs")
    args = ap.parse_args(argv)
    operators = [("this", None)] + ([("baseline", args.baseline)] if args.baseline else [])
    results: list[RunResult] = []
    with control_plane(args) as plane:
        for run in range(1, args.runs + 1):
            for name, package in operators:
                result = run_once(plane, args, name, package, run)
                results.append(result)
                print(table([result]).splitlines()[-1], flush=True)
    print(
        f"\n{args.units} units x {args.pods} pods, resync {args.resync_seconds:g}s, controller-manager qps "
        f"{args.controller_manager_qps or 'default'}\n"
    )
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
