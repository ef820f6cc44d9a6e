"""The per-job worker: reconciles of one job never overlap, nor do its status refreshes; requests
that wait merge into one pass; a refresh is debounced, follows every reconcile and may run while a
long reconcile does; a failed pass is retried; and the peering objects an operator joins."""

from __future__ import annotations

import asyncio

from diloco_operator.glue.peering import peering_objects
from diloco_operator.runtime.jobs import JobRegistry, JobState, Request


def body(name: str = "j", uid: str = "u1", generation: int = 1) -> dict[str, object]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": uid, "generation": generation}}


class Passes:
    """Reconcile and refresh passes that take some time and record what they were asked, and
    whether two of the same kind (of one job) ever ran at once."""

    def __init__(
        self,
        reconcile_s: float = 0.05,
        refresh_s: float = 0.01,
        fail: int = 0,
        follow_up: Request | None = None,
    ) -> None:
        self.reconcile_s, self.refresh_s = reconcile_s, refresh_s
        self.fail = fail
        self.follow_up = follow_up
        self.log: list[tuple[str, str, float]] = []  # (job, "reconcile:<trigger>" or "refresh", start)
        self.running: dict[tuple[str, str], int] = {}
        self.overlapped = False

    async def _timed(self, job: str, kind: str, label: str, seconds: float) -> None:
        key = (job, kind)
        self.running[key] = self.running.get(key, 0) + 1
        self.overlapped |= self.running[key] > 1
        self.log.append((job, label, asyncio.get_running_loop().time()))
        try:
            await asyncio.sleep(seconds)
            if self.fail:
                self.fail -= 1
                raise RuntimeError("HTTP 503: the apiserver is away")
        finally:
            self.running[key] -= 1

    async def reconcile(self, state: JobState, req: Request) -> None:
        flags = "+chaos" if req.chaos else ""
        await self._timed(state.ref.name, "reconcile", f"reconcile:{req.trigger}{flags}", self.reconcile_s)

    async def refresh(self, state: JobState) -> Request | None:
        await self._timed(state.ref.name, "refresh", "refresh", self.refresh_s)
        follow_up, self.follow_up = self.follow_up, None
        return follow_up

    def of(self, job: str) -> list[str]:
        return [label for j, label, _ in self.log if j == job]


async def settle(registry: JobRegistry) -> None:
    for _ in range(500):
        await asyncio.sleep(0.01)
        if all(w.idle for w in registry.workers.values()):
            return


def registry_for(passes: Passes, debounce: float = 0.01, backoff: float = 0.05) -> JobRegistry:
    return JobRegistry(passes.reconcile, passes.refresh, debounce=debounce, backoff=backoff)


def test_reconciles_never_overlap_and_the_requests_that_wait_merge() -> None:
    async def scenario() -> Passes:
        passes = Passes(reconcile_s=0.1)
        registry = registry_for(passes)
        worker = registry.seen(body())
        worker.request(Request(reconcile=True, trigger="create"))
        await asyncio.sleep(0.02)  # the create pass runs; these wait and make one pass
        worker.request(Request(reconcile=True, trigger="drift"))
        worker.request(Request(reconcile=True, chaos=True, fetch=True, trigger="timer"))
        await settle(registry)
        return passes

    passes = asyncio.run(scenario())
    assert not passes.overlapped
    reconciles = [p for p in passes.of("j") if p.startswith("reconcile")]
    assert reconciles == ["reconcile:create", "reconcile:drift+chaos"]
    assert passes.of("j")[-1] == "refresh"  # every reconcile is followed by a refresh


def test_refreshes_are_debounced_and_run_while_a_long_reconcile_does() -> None:
    async def scenario() -> Passes:
        passes = Passes(reconcile_s=0.5, refresh_s=0.01)
        registry = registry_for(passes, debounce=0.05)
        worker = registry.seen(body())
        worker.request(Request(reconcile=True, trigger="create"))  # a big job being created
        for _ in range(3):
            await asyncio.sleep(0.1)
            for _ in range(50):  # a burst of pod events as its first units come up
                worker.request(Request(trigger="watch"))
        await settle(registry)
        return passes

    passes = asyncio.run(scenario())
    assert not passes.overlapped
    during = [
        label
        for _, label, start in passes.log
        if label == "refresh" and start < passes.log[0][2] + passes.reconcile_s
    ]
    assert len(during) == 3  # one per burst, before the reconcile ended
    assert passes.of("j") == ["reconcile:create", "refresh", "refresh", "refresh", "refresh"]


def test_different_jobs_run_side_by_side() -> None:
    async def scenario() -> int:
        passes = Passes(reconcile_s=0.2)
        registry = registry_for(passes)
        for name in ("a", "b"):
            registry.seen(body(name, f"u-{name}")).request(Request(reconcile=True, trigger="create"))
        await asyncio.sleep(0.1)
        both = sum(n for (_, kind), n in passes.running.items() if kind == "reconcile")
        await settle(registry)
        return both

    assert asyncio.run(scenario()) == 2


def test_a_failed_pass_is_retried_a_refresh_may_ask_for_a_reconcile_and_a_forgotten_job_stops() -> None:
    async def scenario() -> Passes:
        passes = Passes(fail=1, follow_up=Request(reconcile=True, trigger="succeeded"))
        registry = registry_for(passes)
        worker = registry.seen(body())
        worker.request(Request(reconcile=True, trigger="create"))
        await settle(registry)
        await registry.forget("u1")
        worker.request(Request(reconcile=True))  # ignored: the job is gone
        await asyncio.sleep(0.1)
        assert registry.find("ns", "j") is None
        return passes

    passes = asyncio.run(scenario())
    # the create failed and was retried; its refresh asked for a reconcile (the job finished)
    assert passes.of("j") == [
        "reconcile:create",
        "reconcile:create",
        "refresh",
        "reconcile:succeeded",
        "refresh",
    ]


def test_the_registry_keeps_the_latest_body_and_finds_jobs_by_name() -> None:
    async def scenario() -> None:
        passes = Passes()
        registry = registry_for(passes)
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
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "diloco"}}
    ]
    assert [(o["kind"], o["metadata"]) for o in peering_objects("p", ["a", "b"])] == [
        ("KopfPeering", {"name": "p", "namespace": "a"}),
        ("KopfPeering", {"name": "p", "namespace": "b"}),
    ]
