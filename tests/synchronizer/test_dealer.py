"""The job's data dealt to its units by a real synchronizer (POST /v1/data/ranges): the same position
always gets the same range, across kill -9 and against both object stores; no range is dealt twice;
a learner cannot ask far ahead, and nobody without a token is dealt anything."""

from __future__ import annotations

import httpx
import pytest
from diloco_core.dealing import AHEAD
from diloco_core.protocol import DATA_RANGES_PATH

from tests.synchronizer.conftest import StoreTarget, SyncFactory
from tests.synchronizer.helpers import learner_auth

pytestmark = [pytest.mark.integration]
ARGS = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1"]


def ask(url: str, learner: str, position: int, size: int = 8) -> httpx.Response:
    return httpx.post(
        f"{url}/v1{DATA_RANGES_PATH}",
        json={"position": position, "size": size},
        **learner_auth(learner),
        timeout=30,
    )


def dealt(url: str, learner: str, position: int, size: int = 8) -> tuple[int, int, int]:
    resp = ask(url, learner, position, size)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    return body["offset"], body["start"], body["size"]


def test_ranges_are_dealt_once_and_the_same_after_kill_9(
    store: StoreTarget, sync_factory: SyncFactory
) -> None:
    sync = sync_factory(store.url("deal"), ARGS, env=store.env)
    assert dealt(sync.url, "a", 0) == (0, 0, 8)
    assert dealt(sync.url, "b", 5) == (0, 8, 8)
    assert dealt(sync.url, "a", 9) == (8, 16, 8)
    assert dealt(sync.url, "a", 3) == (0, 0, 8)  # asked again: the same
    sync.kill9()
    sync.start()
    assert dealt(sync.url, "a", 7) == (0, 0, 8)
    assert dealt(sync.url, "a", 15) == (8, 16, 8)
    assert dealt(sync.url, "b", 1) == (0, 8, 8)
    # a unit added after the restart starts past everything dealt before it
    assert dealt(sync.url, "c", 0, 4) == (0, 24, 4)
    # a resized unit keeps its ranges, and its new ones take its new size
    assert dealt(sync.url, "b", 8, 16) == (8, 28, 16)


def test_a_learner_is_refused_far_ahead_and_an_unauthenticated_caller_everything(
    sync_factory: SyncFactory,
) -> None:
    sync = sync_factory(None, ARGS)
    too_far = ask(sync.url, "a", AHEAD * 8)
    assert too_far.status_code == 409
    assert too_far.json()["code"] == "deal_refused"
    assert ask(sync.url, "a", AHEAD * 8 - 1).status_code == 200
    anonymous = httpx.post(f"{sync.url}/v1{DATA_RANGES_PATH}", json={"position": 0, "size": 8}, timeout=30)
    assert anonymous.status_code == 401
    for bad in ({"position": -1, "size": 8}, {"position": 0, "size": 0}, {"position": 0}, {"size": 8}):
        resp = httpx.post(f"{sync.url}/v1{DATA_RANGES_PATH}", json=bad, **learner_auth("a"), timeout=30)
        assert resp.status_code == 400, bad
    # nothing was dealt by the refusals: the next unit starts right after a's ranges
    assert dealt(sync.url, "b", 0) == (0, AHEAD * 8, 8)


def test_only_shard_0_deals(sync_factory: SyncFactory) -> None:
    sync = sync_factory(None, [*ARGS, "--num-shards", "2", "--shard-index", "1"])
    resp = ask(sync.url, "a", 0)
    assert resp.status_code == 409
    assert "shard 0" in resp.json()["reason"]
