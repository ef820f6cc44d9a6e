"""The connection cap's arithmetic (the limits themselves are tested against a real process in
``test_bad_input``: slow request heads with a low limit of open files)."""

from __future__ import annotations

import resource

from diloco_sync.connections import FD_RESERVE, MIN_CONNECTIONS, effective_max_connections


def test_the_cap_leaves_descriptors_for_everything_else() -> None:
    assert effective_max_connections(4096, 1_048_576) == 4096
    assert effective_max_connections(4096, 1024) == 1024 - FD_RESERVE
    assert effective_max_connections(4096, 256) == 256 - FD_RESERVE
    assert effective_max_connections(100, 256) == 100
    assert effective_max_connections(4096, 16) == MIN_CONNECTIONS
    assert effective_max_connections(4096, resource.RLIM_INFINITY) == 4096
