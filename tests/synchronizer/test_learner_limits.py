"""How much of the server one learner may hold: the decision, as a table of cases."""

from __future__ import annotations

import pytest
from diloco_sync.learner_limits import default_max_requests, over_limit


@pytest.mark.parametrize(
    ("requests", "uploads", "upload", "refused"),
    [
        (0, 0, True, None),
        (3, 3, True, None),
        (4, 4, True, "4 uploads of this learner are in progress (at most 4)"),
        (4, 4, False, None),  # a long-poll or heartbeat beside 4 uploads
        (24, 0, False, "24 requests of this learner are in progress (at most 24)"),
        (24, 0, True, "24 requests of this learner are in progress (at most 24)"),
    ],
)
def test_a_learner_is_refused_beyond_its_requests_or_uploads_in_progress(
    requests: int, uploads: int, upload: bool, refused: str | None
) -> None:
    assert over_limit(requests, uploads, upload=upload, max_requests=24, max_uploads=4) == refused


def test_the_default_request_limit_leaves_room_for_a_long_poll_per_fragment() -> None:
    assert default_max_requests(4) == 24
    assert default_max_requests(100) > 100
