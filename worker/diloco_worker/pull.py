"""The synchronizer pulls partial progress (docs/algorithm.md §3.4): when a round of fragment p opens on the
version this learner started from, the learner sends what it has so far instead of waiting for its own
H steps, so that a slower learner is merged instead of overwritten before it ever sends.
"""

from __future__ import annotations


def should_send_partial(
    *, requested_version: int | None, base_version: int, steps: int, sent_at: int, pending: bool
) -> bool:
    """Whether to answer a round's request with the partial outer gradient of a fragment now.

    ``requested_version``: the version of the round announced for the fragment (None: no request);
    ``steps``/``sent_at``: inner steps since the last global version, and their value at the last send
    since it (0: nothing sent); ``pending``: an outer gradient of the fragment still waits to be sent.
    A learner answers only a round on its own base version, once it has taken at least one step, when
    nothing of it is on its way and nothing was sent since that version (never twice into one round).
    """
    return (
        requested_version is not None
        and requested_version == base_version
        and base_version >= 0
        and steps >= 1
        and sent_at == 0
        and not pending
    )
