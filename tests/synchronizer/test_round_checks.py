"""A contribution that would poison the global model is excluded from its round with a reason, and
the others still merge; after a kill -9, a stored one is replayed and excluded the same way. Against
a real synchronizer process (file store)."""

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


def assert_merged_without_b(sync: SyncProcess, a: Learner) -> None:
    got = a.fetch(0, newer_than=0, wait=30)
    assert got is not None
    version, values = got
    assert version == 1
    for name, v in values.items():
        assert np.isfinite(v).all(), name
        assert not np.array_equal(v, initial_params(PLAN, 0)[name]), name  # a's outer gradient was applied
    fragment = status(sync.url)["fragments"][0]  # type: ignore[index]
    assert (fragment["version"], fragment["excluded"]) == (1, 1)
    assert status(sync.url)["recent_rounds"][-1]["participants"] == ["a"]  # type: ignore[index]
    assert 'diloco_sync_contributions_total{result="excluded"} 1.0' in httpx.get(f"{sync.url}/metrics").text
    log = sync.log_path.read_text()
    assert "contribution b/0/0/1 of learner b excluded from the round" in log


def test_a_poison_contribution_is_excluded_and_the_others_merge(sync_factory: SyncFactory) -> None:
    sync = sync_factory(args=ARGS)
    a, b = learners(sync)
    assert a.init(0, initial_params(PLAN, 0)).status_code == 200
    assert b.contribute(0, 0, poison(), seq=1).status_code == 202
    assert a.contribute(0, 0, encode_grad(outer_grad(PLAN, 0, seed=1), 0, 0), seq=1).status_code == 202
    assert_merged_without_b(sync, a)


def test_a_stored_poison_contribution_is_excluded_when_replayed_after_kill_9(
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
    assert_merged_without_b(sync, a)
