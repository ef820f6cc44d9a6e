"""Which synchronizer shard owns a fragment: the one assignment rule that the synchronizer (which
answers 421 for a fragment it does not own) and the learner (which routes its calls) both use."""

from __future__ import annotations


def shard_of(fragment: int, num_shards: int) -> int:
    """The shard that owns ``fragment``: fragment p belongs to shard p % num_shards."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, not {num_shards}")
    return fragment % num_shards


def shard_fragments(shard: int, num_shards: int, fragments: int) -> list[int]:
    """The fragments (of ``fragments`` in all) that ``shard`` owns, in order."""
    return [p for p in range(fragments) if shard_of(p, num_shards) == shard]
