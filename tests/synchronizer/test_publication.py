"""What a fragment serves: a version in memory up to ``--served-in-memory-bytes``, else where it is
stored, and compressed downloads compared with its size either way (pure)."""

from __future__ import annotations

import asyncio

from diloco_core import codec
from diloco_core.fragments import build_plan
from diloco_sync.publication import Publication, Stored, served_form, served_from_storage, served_size


def test_a_version_larger_than_the_limit_is_served_from_its_object() -> None:
    assert served_form(b"x" * 10, "p/v1", 10) == b"x" * 10
    assert served_form(b"x" * 11, "p/v1", 10) == Stored("p/v1", 11)
    assert served_form(b"", "p/v1", 0) == b""
    assert (served_size(b"abc"), served_size(Stored("k", 7))) == (3, 7)


def test_a_chain_of_updates_is_weighed_against_the_stored_version_size() -> None:
    async def run() -> None:
        pub = Publication()
        pub.publish(0, Stored("v0", 100))
        pub.publish(1, Stored("v1", 100), update=b"u" * 40)
        pub.publish(2, Stored("v2", 100), update=b"u" * 40)
        assert pub.payload_for(0, 0) == (1, b"u" * 40)  # 80 bytes of chain against 100 stored
        pub.publish(3, Stored("v3", 100), update=b"u" * 40)
        assert pub.payload_for(0, 0) == (3, Stored("v3", 100))  # 120 against 100: the whole version
        assert pub.payload_for(-1, -1) == (3, Stored("v3", 100))

    asyncio.run(run())


def test_a_fragment_whose_version_can_be_larger_than_the_limit_is_served_from_storage() -> None:
    spec = build_plan([("w", [256, 64])], 1, 4, 1).fragments[0]
    bound = codec.max_payload_size(spec)
    assert bound > 4 * spec.numel  # the most a version of it can be: its fp32 values and more
    assert served_from_storage(spec, bound - 1)
    assert not served_from_storage(spec, bound)
