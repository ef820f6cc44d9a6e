"""Where a learner sends each fragment's calls: the routing table built from the register answer.

Pure: the answer of the shard the learner was given (its ``shards`` list and the fragments it
answered for) goes in, a :class:`Routes` comes out. The assignment rule itself is
:func:`diloco_core.sharding.shard_of`, shared with the synchronizer.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from diloco_core.protocol import ShardInfo
from diloco_core.sharding import shard_fragments, shard_of


class RoutingError(ValueError):
    """The synchronizer's shard list cannot be used (a missing URL, a different assignment)."""


@dataclass(frozen=True)
class Shard:
    index: int
    url: str
    fragments: tuple[int, ...]


@dataclass(frozen=True)
class Routes:
    """The synchronizer's shards, in shard order; ``home`` is the one the learner was given (its
    URL is the address the learner was started with), None when the answer does not tell which."""

    shards: tuple[Shard, ...]
    home: int | None

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def owner(self, fragment: int) -> int:
        return shard_of(fragment, self.num_shards)

    def others(self) -> tuple[Shard, ...]:
        """The shards besides the home one: the learner registers with each of them as well."""
        return tuple(s for s in self.shards if s.index != self.home)


def single_route(url: str, fragments: int) -> Routes:
    """One synchronizer that owns every fragment."""
    return Routes(shards=(Shard(0, url, tuple(range(fragments))),), home=0)


def _same_url(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def build_routes(
    given_url: str, shards: Sequence[ShardInfo], answered: Collection[int], fragments: int
) -> Routes:
    """The routes of a job of ``fragments`` fragments, from the register answer of ``given_url``.

    ``shards`` is the answer's shard list, ``answered`` the fragments its versions cover (the ones
    the answering shard owns). No list or a one-shard list: everything goes to ``given_url``, as
    with an unsharded synchronizer. Otherwise every shard needs a URL, and each shard's fragments
    must follow :func:`shard_of`; the home shard is the one owning ``answered``, or, when that
    shard owns no fragment, the one announced with ``given_url``.
    """
    if len(shards) <= 1:
        return single_route(given_url, fragments)
    n = len(shards)
    ordered = sorted(shards, key=lambda s: s.index)
    if [s.index for s in ordered] != list(range(n)):
        raise RoutingError(f"the synchronizer announces shards {[s.index for s in ordered]}, not 0..{n - 1}")
    for s in ordered:
        if not s.url:
            raise RoutingError(
                f"the synchronizer runs {n} shards but announces no URL for shard {s.index}: "
                "start every shard with --shard-urls (DILOCO_SHARD_URLS)"
            )
        expected = shard_fragments(s.index, n, fragments)
        if sorted(s.fragments) != expected:
            raise RoutingError(
                f"shard {s.index} announces fragments {sorted(s.fragments)}, but fragment p belongs to "
                f"shard p % {n} (expected {expected}): the learner and synchronizer versions differ"
            )
    owned = sorted(answered)
    if owned:
        homes = [s.index for s in ordered if list(s.fragments) == owned]
        if not homes:
            raise RoutingError(f"no announced shard owns the fragments {owned} that {given_url} answered for")
    else:
        homes = [s.index for s in ordered if _same_url(s.url, given_url)]
    home = homes[0] if homes else None
    table = tuple(
        Shard(s.index, given_url if s.index == home else s.url, tuple(sorted(s.fragments))) for s in ordered
    )
    return Routes(shards=table, home=home)
