"""A refused (stale) contribution makes the learner resynchronise that fragment, against a real synchronizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from diloco_core import protocol as proto
from diloco_core.auth import learner_token
from diloco_core.codec import encode
from diloco_core.fragments import build_plan
from diloco_testbed.waiting import wait_for
from diloco_worker.comms import CommSettings, Communicator
from diloco_worker.fragment_state import Outgoing
from diloco_worker.sync_client import SyncClient, SyncRejected

from tests.worker.helpers import SECRET, Synchronizer

pytestmark = pytest.mark.integration
PLAN = build_plan([("w", (8,))], 1, 4, 1)


def _client(sync: Synchronizer, name: str) -> tuple[SyncClient, proto.RegisterResponse]:
    client = SyncClient(sync.url, name, learner_token(SECRET, name))
    req = proto.RegisterRequest(
        learner_id=name, plan=PLAN.to_dict(), plan_hash=PLAN.hash(), tokens_per_step=4
    )
    return client, client.register(req)


def test_stale_contribution_is_refused_and_the_fragment_is_fetched_again(tmp_path: Path) -> None:
    sync = Synchronizer(tmp_path, inner_steps=4, fragments=1, extra=["--max-staleness", "0"])
    sync.start()
    try:
        x, reg = _client(sync, "x")
        assert reg.needs_init == [0]
        x.init_fragment(
            0,
            encode(
                {"w": np.zeros(8, np.float32)}, fragment=0, base_version=-1, kind="params", quantizer="fp32"
            ),
        )
        y, _ = _client(sync, "y")
        delta = {"w": np.full(8, 0.5, np.float32)}
        blob = encode(delta, fragment=0, base_version=0, kind="outer_grad", quantizer="fp32")
        y.contribute(0, blob, base_version=0, steps=4, tokens=16, seq=1)
        wait_for(lambda: sync.versions()[0] >= 1, timeout=30, what="y's contribution merged")
        new_version = sync.versions()[0]

        with pytest.raises(SyncRejected) as refused:
            x.contribute(0, blob, base_version=0, steps=4, tokens=16, seq=1)
        assert refused.value.code == "stale"

        # x believes it already has the newest version: only the resync can bring it back
        comm = Communicator(x, PLAN, CommSettings(codec="fp32", poll_wait_s=1.0), versions={0: new_version})
        comm.start()
        try:
            comm.submit(Outgoing(0, 0, 4, 16, 2, delta))
            arrivals = wait_for(comm.take_arrivals, timeout=30, what="the fragment fetched again")
            assert comm.rejected == 1
            version, tensors = arrivals[0]
            assert version == new_version
            assert not np.allclose(tensors["w"], 0.0)  # the merged global, not the initial zeros
        finally:
            comm.stop()
    finally:
        sync.stop()
