"""The fragment → shard assignment shared by the synchronizer and the learner."""

from __future__ import annotations

import pytest
from diloco_core.sharding import shard_fragments, shard_of


@pytest.mark.parametrize(
    ("fragment", "num_shards", "shard"),
    [(0, 1, 0), (5, 1, 0), (0, 2, 0), (1, 2, 1), (2, 2, 0), (3, 2, 1), (7, 3, 1), (2, 4, 2)],
)
def test_fragment_p_belongs_to_shard_p_mod_n(fragment: int, num_shards: int, shard: int) -> None:
    assert shard_of(fragment, num_shards) == shard


def test_every_fragment_has_exactly_one_shard() -> None:
    for n in range(1, 6):
        owned = [shard_fragments(i, n, 11) for i in range(n)]
        assert sorted(p for fragments in owned for p in fragments) == list(range(11))
        assert owned[0] == list(range(0, 11, n))


def test_a_shard_may_own_nothing_when_there_are_more_shards_than_fragments() -> None:
    assert shard_fragments(3, 4, 2) == []


def test_zero_shards_is_refused() -> None:
    with pytest.raises(ValueError, match="num_shards"):
        shard_of(0, 0)
