"""The per-shard clients: which client a fragment's calls go through (no call is made here)."""

from __future__ import annotations

from diloco_core.protocol import ShardInfo
from diloco_worker.routing import build_routes
from diloco_worker.sync_client import ShardClients, SyncClient


def test_each_fragment_uses_its_owners_client_and_the_given_one_serves_the_home_shard() -> None:
    home = SyncClient("http://sync-svc:8470", "a", "t")
    shards = [ShardInfo(index=i, url=f"http://sync-{i}:8470", fragments=[i, i + 2]) for i in range(2)]
    clients = ShardClients.connect(build_routes(home.base_url, shards, [1, 3], 4), home)
    try:
        assert clients.home() is home
        assert clients.shard(1) is home
        assert [clients.owner(p).base_url for p in range(4)] == [
            "http://sync-0:8470", "http://sync-svc:8470", "http://sync-0:8470", "http://sync-svc:8470",
        ]  # fmt: skip
        assert clients.shard(0).learner_id == "a"
    finally:
        clients.close()


def test_one_synchronizer_serves_every_fragment() -> None:
    client = SyncClient("http://sync:8470", "a", "t")
    single = ShardClients.single(client, 3)
    assert single.indices == [0]
    assert all(single.owner(p) is client for p in range(3))
    client.close()
