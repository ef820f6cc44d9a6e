"""The I/O of `diloco bench queue`: the control plane with Kueue and the operator, one mode's quota
phases, and the learner processes that follow their pods (see ``queue_goodput``)."""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
from diloco_testbed.kueue import Kueue
from diloco_testbed.kueue_objects import cpu_quota, queued_pod, set_quota, team_queue
from kubernetes import client as k8s

from diloco.runner.commands import (
    RunPaths,
    build_synchronizer_argv,
    build_synchronizer_env,
    build_worker_argv,
    build_worker_env,
)
from diloco.runner.processes import Child, free_port, launch, stop_all
from diloco.runner.settings import RunSettings
from diloco_bench.operator_cluster import GROUP, PLURAL, VERSION, control_plane, wait
from diloco_bench.operator_scale import operator_process
from diloco_bench.queue_cluster import LEARNERS, job_manifest, running_learners
from diloco_bench.queue_goodput import PHASES, ModeResult, Sample

TICK_S = 0.5
SETTLE_S = 15.0


def run_modes(a: argparse.Namespace, modes: list[str]) -> list[ModeResult]:
    plane_args = argparse.Namespace(
        units=LEARNERS, pods=1, controller_manager_qps=None, keep_logs=a.keep_logs
    )
    with control_plane(plane_args) as plane:
        kueue = Kueue(plane, Path(plane.workdir) / "kueue")
        kueue.start()
        try:
            return [run_mode(plane, a, mode) for mode in modes]
        finally:
            kueue.stop()


def run_mode(plane: Any, a: argparse.Namespace, mode: str) -> ModeResult:
    print(f"[queue] {mode}: {len(PHASES)} phases of {a.phase_seconds:g} s", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix=f"diloco-bench-queue-{mode}-", dir=plane.workdir))
    with ExitStack() as stack:
        ns = plane.create_namespace(f"queue-{mode}")
        stack.callback(plane.delete_namespace, ns)
        api = stack.enter_context(plane.api_client())
        names = stack.enter_context(team_queue(api, ns, cpu_quota(PHASES[0].quota)))
        operator = operator_process(
            plane, argparse.Namespace(resync_seconds=15.0), mode, None, 0, ns, 0
        )  # no metrics
        operator.start()
        stack.callback(operator.stop)
        wait(lambda: "operator started" in operator.log_path.read_text(errors="replace"), 120, "the operator")
        learners = stack.enter_context(LearnerProcesses(workdir, a.speed_factor))
        return Phases(api, ns, mode, names, learners, a.phase_seconds).run()
    raise AssertionError("unreachable")


class LearnerProcesses:
    """One real synchronizer and, per learner, at most one real learner process (``diloco run``'s
    commands and settings), started and stopped as the learners' pods come and go."""

    def __init__(self, workdir: Path, speed_factor: float) -> None:
        base = RunSettings()
        self.settings = RunSettings(
            learners=LEARNERS,
            python=sys.executable,
            mtbf_s=0.0,
            speed_factors=(speed_factor,) * LEARNERS,
            train=base.train.model_copy(update={"max_steps": 1_000_000}),
        )
        self.paths = RunPaths(workdir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.secret = secrets.token_hex(16)
        self.children: dict[int, Child] = {}
        self.launches = 0
        self.sync: Child | None = None
        self.http = httpx.Client(base_url=self.url, timeout=5.0)
        self.tokens: dict[str, int] = {}

    def __enter__(self) -> LearnerProcesses:
        argv = build_synchronizer_argv(self.settings, self.paths, port=self.port)
        env = build_synchronizer_env(dict(os.environ), job_secret=self.secret)
        self.sync = launch("synchronizer", argv, self.paths.log_file("synchronizer"), env)
        wait(lambda: self.trained() is not None, 60, f"the synchronizer at {self.url}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_learners()
        if self.sync is not None:
            stop_all([self.sync], 15.0)
        self.http.close()

    def follow(self, running: set[int]) -> None:
        """A process for each learner whose pod runs (once its previous one has exited), SIGTERM to
        each whose pod does not."""
        for learner in range(LEARNERS):
            child = self.children.get(learner)
            alive = child is not None and child.alive()
            if learner in running and not alive:
                argv = build_worker_argv(self.settings, self.paths, learner, sync_url=self.url)
                env = build_worker_env(
                    self.settings, learner, dict(os.environ), job_secret=self.secret, master_port=0
                )
                self.children[learner] = launch(
                    f"learner-{learner}", argv, self.paths.log_file(f"learner-{learner}"), env
                )
                self.launches += 1
            elif learner not in running and alive and child is not None:
                child.terminate()

    def stop_learners(self) -> None:
        stop_all([c for c in self.children.values() if c.alive()], 30.0)

    def trained(self) -> int | None:
        """Tokens the learners trained, as the synchronizer holds their counts (each learner's
        largest, so a learner that left and came back is not counted twice); None while it does not
        answer."""
        try:
            resp = self.http.get("/v1/status")
            if resp.status_code != 200:
                return None
            for learner in resp.json().get("learners", []):
                name, tokens = learner["learner_id"], int(learner["tokens"])
                self.tokens[name] = max(self.tokens.get(name, 0), tokens)
        except (httpx.HTTPError, ValueError, KeyError):
            return None
        return sum(self.tokens.values())


class Phases:
    """One mode's run: the job created, the quota changed at each phase, the learners following
    their pods, a sample every tick."""

    def __init__(
        self, api: Any, ns: str, mode: str, names: dict[str, str], learners: LearnerProcesses, phase_s: float
    ) -> None:
        self.api, self.core, self.custom = api, k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
        self.ns, self.mode, self.names, self.learners = ns, mode, names, learners
        self.result = ModeResult(mode, phase_s)

    def run(self) -> ModeResult:
        job = job_manifest(f"queue-{self.mode}", self.mode, self.names["low"])
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, job)
        selector = f"diloco.dev/job={job['metadata']['name']},app.kubernetes.io/component=learner"
        t0 = time.monotonic()
        end = len(PHASES) * self.result.phase_s
        phase = -1
        while (now := time.monotonic() - t0) < end:
            current = int(now // self.result.phase_s)
            if current != phase:
                phase = current
                self.enter(phase)
            pods = self.api.sanitize_for_serialization(
                self.core.list_namespaced_pod(self.ns, label_selector=selector)
            )
            running = running_learners(pods["items"])
            self.learners.follow(running)
            tokens = self.learners.trained()
            last = self.result.samples[-1].tokens if self.result.samples else 0
            self.result.samples.append(Sample(now, len(running), last if tokens is None else tokens))
            time.sleep(TICK_S)
        self.result.samples.append(
            Sample(end, 0, self.result.samples[-1].tokens if self.result.samples else 0)
        )
        self.learners.stop_learners()
        self.result.tokens = self.settled_tokens()
        self.result.launches = self.learners.launches
        return self.result

    def enter(self, index: int) -> None:
        """Set the phase's quota, and create or delete the higher-priority pod."""
        phase = PHASES[index]
        print(f"[queue] {self.mode}: phase {index + 1} ({phase.name})", flush=True)
        set_quota(self.api, self.names, cpu_quota(phase.quota))
        previous = PHASES[index - 1] if index else None
        if phase.urgent and not (previous and previous.urgent):
            self.core.create_namespaced_pod(self.ns, queued_pod("urgent", self.names["high"]))
        elif previous is not None and previous.urgent and not phase.urgent:
            self.core.delete_namespaced_pod("urgent", self.ns, grace_period_seconds=0)

    def settled_tokens(self) -> int:
        """The learners' tokens once their last heartbeats are in (unchanged for 3 s, or SETTLE_S)."""
        deadline = time.monotonic() + SETTLE_S
        last, since = self.learners.trained() or 0, time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - since < 3.0:
            time.sleep(0.5)
            now = self.learners.trained() or 0
            if now != last:
                last, since = now, time.monotonic()
        return last
