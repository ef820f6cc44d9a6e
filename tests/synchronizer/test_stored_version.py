"""A version larger than ``--served-in-memory-bytes`` is served from its object in storage, piece
by piece, bit for bit what a learner following the updates holds; an object that cannot be read
answers 503 (retryable). Real synchronizer processes on both object stores."""

from __future__ import annotations

import numpy as np
import pytest
from diloco_core.fragments import build_plan
from diloco_core.layout import Layout
from diloco_core.storage import open_store

from tests.synchronizer.conftest import StoreTarget, SyncFactory
from tests.synchronizer.helpers import Learner, encode_grad, initial_params, outer_grad

pytestmark = pytest.mark.integration
PLAN = build_plan([("h.0.w", [2048, 1600]), ("h.1.w", [64, 64])], 1, 4, 1)  # 13 MB: two pieces
ARGS = ["--fragments", "1", "--inner-steps", "4", "--overlap", "1", "--quorum", "1"]


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def test_a_large_version_is_served_from_storage(
    sync_factory: SyncFactory, store: StoreTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = store.url("stored")
    sync = sync_factory(url, [*ARGS, "--served-in-memory-bytes", "1048576"], store.env)
    learner = Learner(sync.url, "a", PLAN)
    assert learner.register().status_code == 200
    v0 = initial_params(PLAN, 0)
    assert learner.init(0, v0).status_code == 200
    got = learner.fetch(0)
    assert got is not None
    assert got[0] == 0
    _same(got[1], v0)

    r = learner.contribute(0, 0, encode_grad(outer_grad(PLAN, 0, seed=1), 0, 0))
    assert r.status_code == 202, r.text
    whole = learner.fetch(0, newer_than=0, wait=30)  # the whole version, from storage
    followed = learner.fetch(0, newer_than=0, wait=30, have=(0, v0))  # the update from version 0
    assert whole is not None
    assert followed is not None
    assert whole[0] == followed[0] == 1
    assert learner.updates == 1  # the second came as the update, applied to version 0
    _same(whole[1], followed[1])

    for name, value in store.env.items():
        monkeypatch.setenv(name, value)
    open_store(url).delete(Layout(0).params(0, 1))  # as if collected: nothing to read
    r = learner.client.get("/v1/fragments/0", params={"newer_than": 0})
    assert r.status_code == 503, r.text
    assert (r.json()["code"], r.json()["retryable"]) == ("storage_unavailable", True)
    assert "params-" not in r.text  # no storage key told
    learner.close()


@pytest.mark.parametrize(
    "outer",
    [
        pytest.param(["--outer-momentum", "0.9"], id="nesterov"),
        pytest.param(
            ["--delayed-nesterov", "2", "--down-codec", "int4"], id="delayed-and-compressed-downloads"
        ),
    ],
)
def test_state_read_back_for_each_round_gives_the_versions_held_in_memory(
    sync_factory: SyncFactory, store: StoreTarget, outer: list[str]
) -> None:
    """Between rounds a large version's parameters and outer state (momentum, the delayed buffer, the
    download residual) are let go and read back from the committed objects by the next round, also
    after a kill -9: the versions are bit for bit those of a synchronizer that keeps them in memory."""
    args = [*ARGS, *outer]
    kept = sync_factory(store.url("in-memory"), args, store.env)
    stored = sync_factory(store.url("in-storage"), [*args, "--served-in-memory-bytes", "1048576"], store.env)
    learners = [Learner(s.url, "a", PLAN) for s in (kept, stored)]
    for learner in learners:
        assert learner.register().status_code == 200
        assert learner.init(0, initial_params(PLAN, 0)).status_code == 200
    got: list[dict[str, np.ndarray]] = [{}, {}]
    for version in range(4):
        if version == 2:  # the state the next rounds start from is only in storage
            stored.kill9()
            stored.start()
        for i, learner in enumerate(learners):
            grad = encode_grad(outer_grad(PLAN, 0, seed=10 + version), 0, version)
            r = learner.contribute(0, version, grad, seq=version + 1)
            assert r.status_code == 202, r.text
            new = learner.fetch(0, newer_than=version, wait=60)
            assert new is not None
            assert new[0] == version + 1
            got[i] = new[1]
        _same(got[0], got[1])
    for learner in learners:
        learner.close()
