"""A fragment of a billion-parameter model's size is taken whole: initial parameters of 1 GiB in
fp32 (four times the 256 MiB that bodies were once held to) are accepted, kept in both kinds of
storage (on S3 in parts), and served back bit for bit."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from diloco_core import codec
from diloco_core.fragments import build_plan

from tests.synchronizer.conftest import StoreTarget, SyncFactory
from tests.synchronizer.helpers import Learner

SIDE = 16384  # one tensor of 16,384 x 16,384 values: 1 GiB in fp32
PLAN = build_plan([("h.0.w", [SIDE, SIDE])], 1, 4, 1)
ARGS = ["--fragments", "1", "--inner-steps", "4", "--overlap", "1", "--quorum", "1"]


@pytest.mark.slow
@pytest.mark.integration
def test_a_one_gib_fp32_initial_fragment_is_accepted_stored_and_served(
    sync_factory: SyncFactory, store: StoreTarget
) -> None:
    sync = sync_factory(store.url("large"), ARGS, store.env)
    learner = Learner(sync.url, "a", PLAN)
    assert learner.register().status_code == 200
    values = np.random.default_rng(0).standard_normal((SIDE, SIDE), dtype=np.float32)
    digest = hashlib.sha256(memoryview(values).cast("B")).hexdigest()
    blob = codec.encode(
        {"h.0.w": values}, fragment=0, base_version=0, kind="params", quantizer="fp32", level=1
    )
    del values
    assert len(blob) > 256 << 20, len(blob)
    put = learner.client.put("/v1/fragments/0/init", content=blob, timeout=600)
    del blob
    assert put.status_code == 200, put.text
    got = learner.client.get("/v1/fragments/0", timeout=600)
    assert got.status_code == 200, got.text
    served = codec.decode(got.content, fragment=PLAN.fragments[0]).tensors["h.0.w"]
    assert hashlib.sha256(memoryview(served).cast("B")).hexdigest() == digest
