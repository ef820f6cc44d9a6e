"""The per-job worker: passes of one job never overlap, requests that wait merge into one pass, a
status refresh is debounced, a failed pass is retried; and the peering objects an operator joins."""

from __future__ import annotations

import asyncio

from diloco_operator.jobs import JobRegistry, JobState, Request
from diloco_operator.peering import peering_objects


def body(name: str = "j", uid: str = "u1", generation: int = 1) -> dict[str, object]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": uid, "generation": generation}}


class Recorder:
    """A pass that takes ``duration`` seconds and records what it was asked and whether another
    pass of the same job was running meanwhile."""

    def __init__(self, duration: float = 0.05, fail: int = 0) -> None:
        self.duration = duration
        self.fail = fail
        self.calls: list[Request] = []
        self.running = 0
        self.overlapped = False

    async def __call__(self, state: JobState, req: Request) -> Request | None:
        self.running += 1
        self.overlapped |= self.running > 1
        try:
            await asyncio.sleep(self.duration)
            self.calls.append(req)
            if self.fail:
                self.fail -= 1
                raise RuntimeError("HTTP 503: the apiserver is away")
            return None
        finally:
            self.running -= 1


async def settle(registry: JobRegistry) -> None:
    for _ in range(200):
        await asyncio.sleep(0.01)
        if all(w._task is None or w._task.done() for w in registry.workers.values()) and \
                all(w._pending is None for w in registry.workers.values()):
            return


def test_passes_of_a_job_never_overlap_and_waiting_requests_merge() -> None:
    async def scenario() -> Recorder:
        run = Recorder(duration=0.1)
        registry = JobRegistry(run, debounce=0.01, backoff=0.05)
        worker = registry.seen(body())
        worker.request(Request(reconcile=True, trigger="create"))
        await asyncio.sleep(0.02)  # the reconcile runs; these wait and make one pass
        for _ in range(20):
            worker.request(Request(trigger="watch"))
        worker.request(Request(reconcile=True, chaos=True, fetch=True, trigger="timer"))
        await settle(registry)
        return run

    run = asyncio.run(scenario())
    assert not run.overlapped
    assert [(r.reconcile, r.chaos, r.fetch, r.trigger) for r in run.calls] == \
        [(True, False, False, "create"), (True, True, True, "timer")]


def test_status_refreshes_are_debounced_and_different_jobs_run_side_by_side() -> None:
    async def scenario() -> tuple[Recorder, int]:
        run = Recorder(duration=0.05)
        registry = JobRegistry(run, debounce=0.05, backoff=0.05)
        one, two = registry.seen(body("a", "ua")), registry.seen(body("b", "ub"))
        for _ in range(50):  # a burst of pod events
            one.request(Request(trigger="watch"))
            two.request(Request(trigger="watch"))
        await asyncio.sleep(0.07)
        both = run.running
        await settle(registry)
        return run, both

    run, both = asyncio.run(scenario())
    assert [r.trigger for r in run.calls] == ["watch", "watch"]  # one pass per job
    assert both == 2


def test_a_failed_pass_is_retried_and_a_forgotten_job_stops() -> None:
    async def scenario() -> tuple[Recorder, int]:
        run = Recorder(fail=1)
        registry = JobRegistry(run, debounce=0.0, backoff=0.05)
        worker = registry.seen(body())
        worker.request(Request(reconcile=True, trigger="create"))
        await asyncio.sleep(0.3)
        calls = len(run.calls)
        await registry.forget("u1")
        worker.request(Request(reconcile=True))  # ignored: the job is gone
        await asyncio.sleep(0.1)
        assert registry.find("ns", "j") is None
        return run, calls

    run, calls = asyncio.run(scenario())
    assert calls == 2  # the failure, then the retry
    assert len(run.calls) == 2


def test_the_registry_keeps_the_latest_body_and_finds_jobs_by_name() -> None:
    async def scenario() -> None:
        registry = JobRegistry(Recorder(), debounce=0.0, backoff=0.0)
        first = registry.seen(body(generation=1))
        again = registry.seen(body(generation=2))
        assert first is again
        assert again.state.body["metadata"] == body(generation=2)["metadata"]
        assert registry.find("ns", "j") is first
        assert registry.find("other", "j") is None
        await registry.stop_all()

    asyncio.run(scenario())


def test_peering_objects_cluster_wide_or_one_per_watched_namespace() -> None:
    assert peering_objects("diloco", []) == [
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "diloco"}}]
    assert [(o["kind"], o["metadata"]) for o in peering_objects("p", ["a", "b"])] == [
        ("KopfPeering", {"name": "p", "namespace": "a"}), ("KopfPeering", {"name": "p", "namespace": "b"})]
