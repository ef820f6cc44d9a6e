"""The learner's routing table, built from the register answer of the shard it was given."""

from __future__ import annotations

import pytest
from diloco_core.protocol import ShardInfo
from diloco_worker.routing import RoutingError, Shard, build_routes, single_route

A, B, C = "http://sync-0:8470", "http://sync-1:8470", "http://sync-2:8470"


def _shards(*urls: str, fragments: int = 4) -> list[ShardInfo]:
    n = len(urls)
    return [ShardInfo(index=i, url=u, fragments=list(range(i, fragments, n))) for i, u in enumerate(urls)]


def test_an_unsharded_synchronizer_serves_every_fragment_at_the_given_url() -> None:
    for shards in ([], [ShardInfo(index=0, url="", fragments=[0, 1, 2])]):
        routes = build_routes("http://given", shards, [0, 1, 2], 3)
        assert routes == single_route("http://given", 3)
        assert routes.shards == (Shard(0, "http://given", (0, 1, 2)),)
        assert [routes.owner(p) for p in range(3)] == [0, 0, 0]
        assert routes.others() == ()


def test_each_fragment_goes_to_its_owner_and_the_home_shard_keeps_the_given_address() -> None:
    routes = build_routes("http://sync-svc/", _shards(A, B), answered=[0, 2], fragments=4)
    assert routes.home == 0
    assert routes.shards == (Shard(0, "http://sync-svc/", (0, 2)), Shard(1, B, (1, 3)))
    assert [routes.owner(p) for p in range(4)] == [0, 1, 0, 1]
    assert routes.others() == (Shard(1, B, (1, 3)),)


def test_the_home_shard_is_the_one_that_answered_whichever_it_is() -> None:
    routes = build_routes(B, _shards(A, B, C, fragments=5), answered=[1, 4], fragments=5)
    assert routes.home == 1
    assert [s.index for s in routes.others()] == [0, 2]
    assert [routes.owner(p) for p in range(5)] == [0, 1, 2, 0, 1]


def test_a_home_shard_owning_no_fragment_is_found_by_its_url_or_left_unknown() -> None:
    shards = _shards(A, B, C, fragments=2)  # shard 2 owns nothing
    assert build_routes(C + "/", shards, answered=[], fragments=2).home == 2
    unknown = build_routes("http://elsewhere", shards, answered=[], fragments=2)
    assert unknown.home is None
    assert [s.index for s in unknown.others()] == [0, 1, 2]  # registers with every announced shard


def test_the_order_of_the_announced_shards_does_not_matter() -> None:
    routes = build_routes(A, list(reversed(_shards(A, B))), answered=[0, 2], fragments=4)
    assert [s.index for s in routes.shards] == [0, 1]


@pytest.mark.parametrize(
    ("shards", "answered", "message"),
    [
        (_shards(A, ""), [0, 2], "no URL for shard 1"),
        ([ShardInfo(index=0, url=A, fragments=[0, 1]), ShardInfo(index=1, url=B, fragments=[2, 3])], [0, 1],
         r"fragment p belongs to shard p % 2"),
        ([ShardInfo(index=0, url=A, fragments=[0, 2]), ShardInfo(index=2, url=B, fragments=[1, 3])], [0, 2],
         "not 0..1"),
        (_shards(A, B), [0, 1], "no announced shard owns"),
    ],
)  # fmt: skip
def test_an_unusable_shard_list_is_refused_with_what_to_change(
    shards: list[ShardInfo], answered: list[int], message: str
) -> None:
    with pytest.raises(RoutingError, match=message):
        build_routes(A, shards, answered, 4)
