"""The job `diloco bench attack` runs against, and a learner's moves on it: the fragment plan, the
synchronizer's arguments, registered clients, outer gradients of a chosen norm, and calls retried
through a synchronizer's kill -9."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from diloco_core import codec
from diloco_core import protocol as proto
from diloco_core.auth import learner_token
from diloco_core.fragments import FragmentPlan, build_plan
from diloco_worker.sync_client import GlobalFragment, SyncClient, SyncRejected, SyncUnavailable

from diloco_bench.sync_process import SECRET, BenchSync

H = 4
SHAPES = [("w", (64, 32)), ("b", (32,))]


def plan() -> FragmentPlan:
    return build_plan(SHAPES, 1, H, 1)


def job_args(quorum: int, *extra: str) -> list[str]:
    return [
        "--fragments",
        "1",
        "--inner-steps",
        str(H),
        "--overlap",
        "1",
        "--quorum",
        str(quorum),
        "--merge-rule",
        "mean",
        "--log-level",
        "WARNING",
        *extra,
    ]


def client(sync: BenchSync, learner: str) -> SyncClient:
    return SyncClient(sync.url, learner, learner_token(SECRET, learner), timeout_s=30.0)


def join(c: SyncClient, the_plan: FragmentPlan, tokens_per_step: int = 8) -> None:
    c.register(
        proto.RegisterRequest(
            learner_id=c.learner_id,
            unit=f"unit-{c.learner_id}",
            plan=the_plan.to_dict(),
            plan_hash=the_plan.hash(),
            tokens_per_step=tokens_per_step,
        )
    )
    c.heartbeat(proto.Heartbeat(step=0, tokens=0, step_time_s=0.0))


def init_params(c: SyncClient, tensors: dict[str, np.ndarray]) -> None:
    """The fragment's first version: these parameters."""
    c.init_fragment(0, codec.encode(tensors, fragment=0, base_version=0, kind="params", quantizer="fp32"))


def of_norm(rng: np.random.Generator, norm: float) -> dict[str, np.ndarray]:
    """An outer gradient of exactly (to float32) this norm."""
    g = {name: rng.standard_normal(shape) for name, shape in SHAPES}
    total = float(np.sqrt(sum(float(np.sum(v * v)) for v in g.values())))
    return {name: (v * (norm / total)).astype(np.float32) for name, v in g.items()}


def norm_of(tensors: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in tensors.values())))


def grad_blob(tensors: dict[str, np.ndarray], base: int) -> bytes:
    return bytes(codec.encode(tensors, fragment=0, base_version=base, kind="outer_grad", quantizer="fp32"))


def fetch_newer(c: SyncClient, the_plan: FragmentPlan, newer_than: int) -> tuple[int, dict[str, np.ndarray]]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = c.fetch(0, newer_than=newer_than, wait_s=10.0)
        if isinstance(got, GlobalFragment):
            payload = codec.decode(got.payload, fragment=the_plan.fragments[0])
            return got.version, dict(payload.tensors)
    raise RuntimeError(f"no version newer than {newer_than} within 60 s")


def in_newest_round(c: SyncClient, learner: str) -> bool:
    """Whether fragment 0's newest round merged ``learner``'s contribution."""
    rounds = [r for r in c.status().recent_rounds if r.fragment == 0]
    return bool(rounds) and learner in max(rounds, key=lambda r: r.version).participants


def clipped_count(c: SyncClient) -> int:
    """Contributions to fragment 0 merged scaled down to their norm limit since the process started."""
    return int(c.status().fragments[0].clipped)


def until_answered(call: Callable[[], proto.ContributionResult]) -> proto.ContributionResult | SyncRejected:
    """The call's answer or refusal, retried while the synchronizer is unavailable."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            return call()
        except SyncRejected as exc:
            return exc
        except SyncUnavailable:
            time.sleep(0.2)
    raise RuntimeError("no answer within 120 s")


def current_version(c: SyncClient) -> int:
    """The fragment's version, asked until the synchronizer answers."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            return int(c.status().fragments[0].version)
        except (SyncUnavailable, SyncRejected, httpx.HTTPError):
            time.sleep(0.2)
    raise RuntimeError("no status within 120 s")


def round_logs(store: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(store.rglob("rounds/*/*.json"))]
