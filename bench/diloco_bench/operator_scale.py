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
import itertools
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
GROUP, VERSION, PLURAL = "diloco.dev", "v1alpha1", "dilocojobs"
JOB = "scale"


@dataclass
class Timeline:
    """(seconds since create, count) each time a count changed."""

    points: list[tuple[float, int]] = field(default_factory=list)

    def add(self, t: float, count: int) -> None:
        if not self.points or self.points[-1][1] != count:
            self.points.append((t, count))

    def first_at_least(self, k: int, after: float = 0.0) -> float | None:
        return next((t for t, c in self.points if c >= k and t >= after), None)

    def first_below(self, k: int, after: float) -> float | None:
        return next((t for t, c in self.points if c < k and t >= after), None)

    def backwards(self, until: float) -> int:
        """Decreases of the count up to ``until``."""
        pts = [c for t, c in self.points if t <= until]
        return sum(1 for a, b in itertools.pairwise(pts) if b < a)


def lags(reality: Timeline, status: Timeline, n: int) -> list[float]:
    """For each k in 1..n reached by both: when the status first showed k minus when reality had k."""
    out = []
    for k in range(1, n + 1):
        r, s = reality.first_at_least(k), status.first_at_least(k)
        if r is not None and s is not None:
            out.append(s - r)
    return out


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


class Watcher:
    """A watch in a thread, feeding each event to ``on_event`` with the time since ``t0``."""

    def __init__(
        self,
        list_fn: Callable[..., Any],
        on_event: Callable[[float, dict[str, Any], str], None],
        t0: float,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        from kubernetes import watch

        self._watch = watch.Watch()
        self._thread = threading.Thread(
            target=self._run, args=(list_fn, on_event, t0, args, kwargs), daemon=True
        )
        self.error: Exception | None = None
        self.restarts = 0
        self._stopped = False

    def _run(
        self,
        list_fn: Callable[..., Any],
        on_event: Callable[[float, dict[str, Any], str], None],
        t0: float,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        while not self._stopped:  # a stream that ends or breaks is opened again (a fresh listing)
            try:
                # The objects as the apiserver sends them (JSON, camelCase): the client's typed
                # models cost milliseconds per pod, and a watch that falls behind on a busy machine
                # would make reality look later than it was.
                for ev in self._watch.stream(
                    list_fn, *args, timeout_seconds=3600, deserialize=False, **kwargs
                ):
                    on_event(time.monotonic() - t0, ev["object"], ev["type"])
            except Exception as exc:  # kept for the report, and the watch restarts
                self.error = exc
                self.restarts += 1
                time.sleep(0.5)

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped = True
        self._watch.stop()


class PodReality:
    """Units whose pods are all Ready, from the benchmark's own pod watch."""

    def __init__(self, pods_per_unit: int) -> None:
        self.pods_per_unit = pods_per_unit
        self.ready: dict[str, tuple[str, bool]] = {}  # pod -> (unit, ready and not deleting)
        self.timeline = Timeline()
        self.lock = threading.Lock()

    def on_event(self, t: float, pod: dict[str, Any], kind: str) -> None:
        meta = pod["metadata"]
        unit = (meta.get("labels") or {}).get("diloco.dev/unit", "")
        conditions = (pod.get("status") or {}).get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        with self.lock:
            if kind == "DELETED":
                self.ready.pop(meta["name"], None)
            else:
                self.ready[meta["name"]] = (unit, ready and not meta.get("deletionTimestamp"))
            per_unit: dict[str, int] = {}
            for u, ok in self.ready.values():
                per_unit[u] = per_unit.get(u, 0) + int(ok)
            self.timeline.add(t, sum(1 for n in per_unit.values() if n >= self.pods_per_unit))


def job_manifest(units: int, pods: int) -> dict[str, Any]:
    unit_resources = {"requests": {"cpu": "10m", "memory": "16Mi"}}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "DiLoCoJob",
        "metadata": {"name": JOB},
        "spec": {
            "images": {
                "worker": "example.invalid/worker:bench",
                "synchronizer": "example.invalid/sync:bench",
            },
            "storage": {"bucket": "diloco-bench"},
            "diloco": {"quorum": 1},
            "synchronizer": {"resources": {"requests": {"cpu": "10m"}}},
            "learnerUnits": [
                {"name": f"u{i:03d}", "replicas": pods, "resources": unit_resources} for i in range(units)
            ],
        },
    }


def scrape_children(port: int) -> tuple[float | None, float | None]:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None, None

    def value(action: str) -> float:
        m = re.search(rf'diloco_operator_children_total{{action="{action}"}} ([0-9.e+]+)', text)
        return float(m.group(1)) if m else 0.0

    return value("created"), value("restored")


def wait(probe: Callable[[], bool], timeout: float, what: str, *watchers: Watcher) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            errors = "; ".join(f"{w.restarts} restart(s), last: {w.error!r}" for w in watchers if w.error)
            raise TimeoutError(
                f"timed out after {timeout:.0f}s waiting for {what}" + (f" ({errors})" if errors else "")
            )
        time.sleep(0.2)


@contextmanager
def control_plane(args: argparse.Namespace) -> Iterator[Any]:
    """The test control plane (``diloco_testbed``, installed with the project), with kwok nodes for the
    job."""
    from diloco_testbed import kwok
    from diloco_testbed.kube import ControlPlane

    extra = {}
    if args.controller_manager_qps:
        qps = args.controller_manager_qps
        extra["kube-controller-manager"] = [f"--kube-api-qps={qps}", f"--kube-api-burst={2 * qps}"]
    workdir = Path(tempfile.mkdtemp(prefix="diloco-bench-operator-"))
    plane = ControlPlane(workdir, extra_args=extra)
    plane.start()
    done = False
    try:
        from kubernetes import client as k8s

        with plane.api_client() as api:
            core = k8s.CoreV1Api(api)
            per_node = 500
            for i in range((args.units * args.pods + 20) // per_node + 1):
                node = kwok.FakeNode(
                    f"kwok-bench-{i}", "region-a", "region-a-1", cpu="1000", memory="4Ti", pods=str(per_node)
                )
                core.create_node(kwok.node_manifest(node))
            ext = k8s.ApiextensionsV1Api(api)
            import yaml

            for path in (ROOT / "crds").glob("*.yaml"):
                for doc in yaml.safe_load_all(path.read_text()):
                    ext.create_custom_resource_definition(doc)
            wait(
                lambda: all(
                    any(
                        c.type == "Established" and c.status == "True"
                        for c in (ext.read_custom_resource_definition(n).status.conditions or [])
                    )
                    for n in ("dilocojobs.diloco.dev",)
                ),
                60,
                "the CRD",
            )
        yield plane
        done = True
    finally:
        plane.close()
        if done and not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"[bench] logs kept in {workdir}")


def run_once(
    plane: Any, args: argparse.Namespace, operator: str, package_dir: str | None, run: int
) -> RunResult:
    from diloco_testbed.ports import free_port
    from diloco_testbed.process import ManagedProcess
    from kubernetes import client as k8s

    ns = plane.create_namespace(f"bench-{operator}-{run}")
    metrics_port = free_port()
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
    proc = ManagedProcess(
        f"operator-{operator}", argv, Path(plane.workdir) / f"operator-{operator}-{run}.log", env=env
    )
    reality = PodReality(args.pods)
    status = Timeline()
    updates = [0]

    def on_job(t: float, job: dict[str, Any], kind: str) -> None:
        ready = (job.get("status") or {}).get("readyUnits")
        if ready is not None:
            updates[0] += 1
            status.add(t, int(ready))

    with plane.api_client() as api:
        core, custom = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
        proc.start()
        try:
            wait(lambda: "operator started" in proc.log_path.read_text(errors="replace"), 120, "the operator")
            t0 = time.monotonic()
            pods_watch = Watcher(
                core.list_namespaced_pod,
                reality.on_event,
                t0,
                ns,
                label_selector=f"diloco.dev/job={JOB},app.kubernetes.io/component=learner",
            ).start()
            job_watch = Watcher(
                custom.list_namespaced_custom_object, on_job, t0, GROUP, VERSION, ns, PLURAL
            ).start()
            custom.create_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, job_manifest(args.units, args.pods)
            )
            n = args.units
            wait(
                lambda: reality.timeline.first_at_least(n) is not None
                and status.first_at_least(n) is not None,
                args.timeout,
                f"{n}/{n} units ready in reality and in the status",
                pods_watch,
                job_watch,
            )
            ready_at = max(reality.timeline.first_at_least(n) or 0.0, status.first_at_least(n) or 0.0)
            created, restored = scrape_children(metrics_port)
            loss_after, before_recovery = None, None
            if args.deletions:
                pods = core.list_namespaced_pod(ns, label_selector=f"diloco.dev/job={JOB}").items
                victims: list[str] = []
                seen_units: set[str] = set()
                for pod in sorted(pods, key=lambda p: p.metadata.name):
                    unit = pod.metadata.labels.get("diloco.dev/unit")
                    if unit and unit not in seen_units and len(victims) < args.deletions:
                        seen_units.add(unit)
                        victims.append(pod.metadata.name)
                t_delete = time.monotonic() - t0
                for name in victims:
                    core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
                wait(lambda: reality.timeline.first_below(n, t_delete) is not None, 60, "the loss in reality")
                wait(
                    lambda: (
                        reality.timeline.first_at_least(n, reality.timeline.first_below(n, t_delete) or 0.0)
                        is not None
                    ),
                    args.timeout,
                    "the units back in reality",
                )
                time.sleep(2 * args.resync_seconds + 2)  # room for a status that only moves on a timer
                dropped = reality.timeline.first_below(n, t_delete) or t_delete
                recovered = reality.timeline.first_at_least(n, dropped) or dropped
                shown = status.first_below(n, t_delete)
                loss_after = None if shown is None else shown - dropped
                before_recovery = shown is not None and shown <= recovered
            pods_watch.stop()
            job_watch.stop()
            lag = lags(reality.timeline, status, n)
            return RunResult(
                operator=operator,
                run=run,
                units=n,
                pods=args.pods,
                reality_ready_s=reality.timeline.first_at_least(n),
                status_ready_s=status.first_at_least(n),
                lag_median_s=statistics.median(lag) if lag else None,
                lag_max_s=max(lag) if lag else None,
                backwards=status.backwards(ready_at),
                status_updates=updates[0],
                children_created=created,
                children_restored=restored,
                loss_shown_after_s=loss_after,
                loss_shown_before_recovery=before_recovery,
                reality=[(round(t, 3), c) for t, c in reality.timeline.points],
                status=[(round(t, 3), c) for t, c in status.points],
            )
        finally:
            proc.stop()
            plane.delete_namespace(ns)


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
