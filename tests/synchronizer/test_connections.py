"""The connection cap's arithmetic (the limits themselves are tested against a real process in
``test_bad_input``: slow request heads with a low limit of open files; under TLS in ``test_tls``)."""

from __future__ import annotations

import resource

from diloco_sync.connections import (
    FD_RESERVE,
    MIN_CONNECTIONS,
    ConnectionLimits,
    body_too_slow,
    effective_max_connections,
)


def test_the_cap_leaves_descriptors_for_everything_else() -> None:
    assert effective_max_connections(4096, 1_048_576) == 4096
    assert effective_max_connections(4096, 1024) == 1024 - FD_RESERVE
    assert effective_max_connections(4096, 256) == 256 - FD_RESERVE
    assert effective_max_connections(100, 256) == 100
    assert effective_max_connections(4096, 16) == MIN_CONNECTIONS
    assert effective_max_connections(4096, resource.RLIM_INFINITY) == 4096


def test_a_body_is_judged_slow_only_after_its_grace_and_below_the_minimum_rate() -> None:
    limits = ConnectionLimits(
        header_timeout_s=10.0, body_timeout_s=60.0, max_connections=8, min_body_rate=1024.0
    )
    assert not body_too_slow(0, 9.9, limits)  # within the grace: a body may start late
    assert body_too_slow(10, 10.0, limits)  # a byte now and then: 1 byte/s
    assert not body_too_slow(10_240, 10.0, limits)  # exactly the minimum
    assert body_too_slow(10_239, 10.0, limits)
    off = ConnectionLimits(header_timeout_s=10.0, body_timeout_s=60.0, max_connections=8)
    assert not body_too_slow(0, 1000.0, off)
