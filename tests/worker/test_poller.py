"""A fragment's long-poll thread against a real local HTTP server: a failure it did not foresee is
logged and the poll retried; the thread lives on and the version is delivered."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

import numpy as np
import pytest
from diloco_core import protocol as proto
from diloco_core.auth import learner_token
from diloco_core.codec import encode_params
from diloco_core.fragments import build_plan
from diloco_worker.comms import CommSettings
from diloco_worker.poller import Poller
from diloco_worker.sync_client import ShardClients, SyncClient

from tests.worker.scripted_server import Answer, HeadedAnswer, serving


def test_a_poll_that_fails_unexpectedly_is_logged_and_retried(caplog: pytest.LogCaptureFixture) -> None:
    """Preparing the first delivered version fails (as a copy to the device could): the thread lives
    on, polls again and delivers the version."""
    plan = build_plan([("w", (4,))], 1, 4, 1)
    values = {"w": np.arange(4, dtype=np.float32)}
    payload = encode_params(values, 0, 1)

    def answer(method: str, path: str) -> Answer | HeadedAnswer:
        return 200, proto.CONTENT_TYPE, payload, {proto.VERSION_HEADER: "1"}

    staged: list[int] = []

    def stage(p: int, arrays: dict[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        staged.append(p)
        if len(staged) == 1:
            raise RuntimeError("the copy to the device failed")
        return arrays

    stop = threading.Event()
    with caplog.at_level(logging.ERROR, logger="diloco_worker.comms"), serving(answer) as url:
        client = SyncClient(url, "a", learner_token("s", "a"))
        poller = Poller(
            ShardClients.single(client, 1),
            plan,
            CommSettings(),
            stop,
            versions={0: 0},
            stage=stage,
            held=None,
        )
        thread = threading.Thread(target=poller.poll_loop, args=(0,), daemon=True)
        thread.start()
        try:
            arrived = poller.wait_for_arrival([0], 30)
            alive = thread.is_alive()
        finally:
            stop.set()
            thread.join(10)
            client.close()
    assert arrived
    assert alive
    version, tensors = poller.take_arrivals()[0]
    assert version == 1
    np.testing.assert_array_equal(tensors["w"], values["w"])
    failed = [r for r in caplog.records if "polling failed unexpectedly" in r.getMessage()]
    assert len(failed) == 1
    assert failed[0].exc_info is not None  # with its traceback
