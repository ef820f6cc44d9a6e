"""A synchronizer assembled in process, without HTTP: the real service, contribution desk and round
runner on a real filesystem store, driven by a fake clock. For fast tests of the state machine and
its neighbours; the wire and crash behaviour is tested against real processes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from diloco_core.config import DiLoCoSettings, JobConfig
from diloco_core.protocol import ContributionResult, Heartbeat, RegisterRequest
from diloco_core.storage import FilesystemStore
from diloco_sync.contributions import ContributionDesk
from diloco_sync.persistence import StateStore
from diloco_sync.round_loop import RoundRunner
from diloco_sync.service import SyncService
from diloco_sync.settings import SyncSettings
from diloco_sync.startup import build_round_parts

from tests.synchronizer.helpers import encode_grad, encode_params, initial_params, outer_grad, tiny_plan

PLAN = tiny_plan()


@dataclass
class FakeClock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class InProcess:
    service: SyncService
    desk: ContributionDesk
    runner: RoundRunner
    clock: FakeClock
    root: Path

    async def start(self, learners: str, step_time_s: float = 1.0) -> None:
        """Load the (empty) state, register and heartbeat ``learners`` (one letter each), init every fragment."""
        await self.service.load()
        for name in learners:
            await self.service.register(
                RegisterRequest(
                    learner_id=name, plan=PLAN.to_dict(), plan_hash=PLAN.hash(), tokens_per_step=8
                )
            )
            self.service.heartbeat(name, Heartbeat(step=1, tokens=8, step_time_s=step_time_s))
        for p in range(len(PLAN.fragments)):
            await self.service.init_fragment(p, encode_params(initial_params(PLAN, p), p))

    async def contribute(
        self, learner: str, p: int = 0, base: int = 0, *, seq: int = 1, tokens: int = 32
    ) -> str:
        """Send an outer gradient of ``learner`` to fragment ``p``; returns the answer's status."""
        blob = encode_grad(outer_grad(PLAN, p, seed=ord(learner) + 100 * seq), p, base)
        result = await self.send(learner, p, blob, base_version=base, steps=4, tokens=tokens, seq=seq)
        return result.status

    async def send(
        self, learner: str, p: int, blob: bytes, *, base_version: int, seq: int, **query: int
    ) -> ContributionResult:
        """The desk's answer to ``blob`` sent as the API sends a body: counted against the pending
        budget, written as it arrives."""
        with self.desk.room(learner, p, base_version, seq, len(blob)):
            body = self.desk.open_body(learner, p, base_version, seq)
            try:
                body.write(blob)
                return await self.desk.contribute(
                    learner, p, base_version=base_version, seq=seq, body=body, **query
                )  # type: ignore[arg-type]
            finally:
                body.discard()

    def pending_objects(self) -> list[str]:
        return self.service.store.store.list(self.service.store.layout.pending_prefix)


def in_process(root: Path, *, service: Mapping[str, object] | None = None, **diloco: object) -> InProcess:
    """A synchronizer of ``tiny_plan()``'s shape (P = 2, H = 4, overlap 1) with ``diloco`` settings
    (and ``service``: other fields of its ``SyncSettings``)."""
    settings = SyncSettings(
        job=JobConfig(
            job_id="in-process",
            diloco=DiLoCoSettings.model_validate({"fragments": 2, "inner_steps": 4, "overlap": 1, **diloco}),
        ),
        job_secret="x",
        storage_url=f"file://{root}",
        tick_s=30.0,  # the tests tick the runner themselves
        **(service or {}),
    )
    clock = FakeClock()
    built = SyncService(settings, StateStore(FilesystemStore(root), 0, "in-process"), clock=clock)
    desk, runner = build_round_parts(built)
    return InProcess(built, desk, runner, clock, root)
