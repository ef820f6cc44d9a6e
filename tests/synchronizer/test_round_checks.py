"""A contribution that would poison the global model (values near float32's largest) is merged
scaled down to the round's norm limit, with a reason, beside the others; after a kill -9, a stored
one is replayed and clipped the same way. Against a real synchronizer process (file store)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.synchronizer.conftest import SyncFactory
from tests.synchronizer.helpers import (
    Learner,
    SyncProcess,
    encode_grad,
    initial_params,
    outer_grad,
    status,
    tiny_plan,
)

pytestmark = pytest.mark.integration
PLAN = tiny_plan(fragments=1)
ARGS = ["--fragments", "1", "--inner-steps", "4", "--overlap", "1", "--quorum", "2", "--merge-rule", "rda"]


def poison() -> bytes:
    """Finite float32 values near the largest: their norm, and any sum of them, overflow."""
    return encode_grad({t.name: np.full(t.shape, 3e38, np.float32) for t in PLAN.fragments[0].tensors}, 0, 0)


def learners(sync: SyncProcess) -> tuple[Learner, Learner]:
    a, b = Learner(sync.url, "a", PLAN), Learner(sync.url, "b", PLAN)
    for learner in (a, b):
        assert learner.register().status_code == 200
        assert learner.heartbeat(4).status_code == 200
    return a, b


def assert_merged_with_b_clipped(sync: SyncProcess, a: Learner) -> None:
    got = a.fetch(0, newer_than=0, wait=30)
    assert got is not None
    version, values = got
    assert version == 1
    initial = initial_params(PLAN, 0)
    moved = np.sqrt(sum(np.sum((values[n].astype(np.float64) - initial[n]) ** 2) for n in values))
    initial_norm = np.sqrt(sum(np.sum(v.astype(np.float64) ** 2) for v in initial.values()))
    for name, v in values.items():
        assert np.isfinite(v).all(), name
    assert 0 < moved <= 10 * initial_norm * (1 + 1e-5)  # at most the limit before any history
    fragment = status(sync.url)["fragments"][0]  # type: ignore[index]
    assert (fragment["version"], fragment["excluded"], fragment["clipped"]) == (1, 0, 1)
    newest = status(sync.url)["recent_rounds"][-1]  # type: ignore[index]
    assert sorted(newest["participants"]) == ["a", "b"]  # type: ignore[index]
    assert [c["learner"] for c in newest["clipped"]] == ["b"]  # type: ignore[index]
    assert 'diloco_sync_contributions_total{result="clipped"} 1.0' in httpx.get(f"{sync.url}/metrics").text
    log = sync.log_path.read_text()
    assert "contribution b/0/0/1 of learner b merged scaled down" in log


def test_a_poison_contribution_is_clipped_and_the_others_merge(sync_factory: SyncFactory) -> None:
    sync = sync_factory(args=ARGS)
    a, b = learners(sync)
    assert a.init(0, initial_params(PLAN, 0)).status_code == 200
    assert b.contribute(0, 0, poison(), seq=1).status_code == 202
    assert a.contribute(0, 0, encode_grad(outer_grad(PLAN, 0, seed=1), 0, 0), seq=1).status_code == 202
    assert_merged_with_b_clipped(sync, a)


def test_a_stored_poison_contribution_is_clipped_when_replayed_after_kill_9(
    sync_factory: SyncFactory,
) -> None:
    sync = sync_factory(args=ARGS)
    a, b = learners(sync)
    assert a.init(0, initial_params(PLAN, 0)).status_code == 200
    assert b.contribute(0, 0, poison(), seq=1).status_code == 202  # below the quorum: it waits, stored
    sync.kill9()
    sync.start()
    a, _ = learners(sync)
    assert a.contribute(0, 0, encode_grad(outer_grad(PLAN, 0, seed=1), 0, 0), seq=1).status_code == 202
    assert_merged_with_b_clipped(sync, a)
