"""Scale-out: two synchronizer replicas share the fragments (fragment p → shard p % 2)."""

from __future__ import annotations

import httpx
import pytest
from diloco_testbed.ports import free_ports

from tests.synchronizer.conftest import SyncFactory
from tests.synchronizer.helpers import Learner, encode_grad, initial_params, outer_grad, status, tiny_plan

pytestmark = pytest.mark.integration
PLAN = tiny_plan(fragments=4, inner_steps=4)


def test_two_shards_split_the_fragments(sync_factory: SyncFactory, tmp_path: object) -> None:
    ports = free_ports(2)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    common = ["--fragments", "4", "--inner-steps", "4", "--overlap", "1", "--quorum", "1", "--num-shards", "2",
              "--shard-urls", ",".join(urls)]  # fmt: skip
    shared_store = f"file://{tmp_path}/shared"
    shards = [sync_factory(shared_store, [*common, "--shard-index", str(i)], port=ports[i]) for i in range(2)]
    learners = [Learner(s.url, "a", PLAN) for s in shards]
    answers = [learner.register().json() for learner in learners]
    for i, body in enumerate(answers):
        assert body["shards"] == [
            {"index": 0, "url": urls[0], "fragments": [0, 2]},
            {"index": 1, "url": urls[1], "fragments": [1, 3]},
        ]
        assert body["needs_init"] == ([0, 2] if i == 0 else [1, 3])
    for p in range(4):
        assert learners[p % 2].init(p, initial_params(PLAN, p)).status_code == 200
    wrong = learners[0].contribute(1, 0, encode_grad(outer_grad(PLAN, 1, 1), 1, 0))
    assert wrong.status_code == 421
    assert wrong.json()["code"] == "wrong_shard"
    assert "shard 1" in wrong.json()["reason"]

    assert learners[1].contribute(1, 0, encode_grad(outer_grad(PLAN, 1, 1), 1, 0)).status_code == 202
    got = learners[1].fetch(1, newer_than=0, wait=20)
    assert got is not None
    assert got[0] == 1
    s0, s1 = status(shards[0].url), status(shards[1].url)
    assert [(f["fragment"], f["version"]) for f in s0["fragments"]] == [(0, 0), (2, 0)]  # type: ignore[index, union-attr]
    assert [(f["fragment"], f["version"]) for f in s1["fragments"]] == [(1, 1), (3, 0)]  # type: ignore[index, union-attr]
    assert (s0["shard"], s1["shard"], s1["num_shards"]) == (0, 1, 2)
    assert httpx.get(f"{shards[0].url}/readyz").status_code == 200
