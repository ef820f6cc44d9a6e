"""kill -9 of the synchronizer mid-round: nothing committed is lost, nothing is applied twice.

A deterministic scenario (3 learners, quorum 3, fixed outer gradients) runs once without a crash and
once with two crashes: (1) after two of three contributions of a round were answered, (2) right
after the last contribution of a round was answered, when the merge may or may not have been
committed. The final global parameters must be bit-for-bit the same. Both object stores are
exercised (a file:// folder and a real S3 server).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from tests.synchronizer.conftest import StoreTarget, SyncFactory
from tests.synchronizer.helpers import (
    Learner,
    SyncProcess,
    encode_grad,
    initial_params,
    outer_grad,
    status,
    tiny_plan,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
PLAN = tiny_plan()
ARGS = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--quorum", "3", "--merge-rule", "rda"]
SCHEDULE = [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1)]  # (fragment, round)
CrashHook = Callable[[SyncProcess, int, int, int], bool]


def blob(p: int, r: int, i: int) -> bytes:
    return encode_grad(outer_grad(PLAN, p, seed=1000 * p + 10 * r + i, scale=0.05), p, r, quantizer="int8")


def run_scenario(sync: SyncProcess, crash: CrashHook, updates: int = 0) -> dict[int, dict[str, np.ndarray]]:
    """The scenario's final versions. Learner 0 follows every version with the update payloads of
    compressed downloads where the synchronizer sends them (at least ``updates`` of them)."""
    learners = [Learner(sync.url, f"learner-{i}", PLAN, tokens_per_step=8 * (i + 1)) for i in range(3)]
    for learner in learners:
        assert learner.register().status_code == 200
    held = {}
    for p in (0, 1):
        assert learners[0].init(p, initial_params(PLAN, p, seed=3)).status_code == 200
        got = learners[0].fetch(p)
        assert got is not None
        held[p] = got
    for p, r in SCHEDULE:
        for i, learner in enumerate(learners):
            resp = learner.contribute(
                p, r, blob(p, r, i), steps=4 + i, tokens=(4 + i) * 8 * (i + 1), seq=100 * p + r
            )
            assert resp.status_code == 202, resp.text
            if crash(sync, p, r, i):
                for j in range(i + 1):  # resend everything answered before the crash: all duplicates
                    again = learners[j].contribute(p, r, blob(p, r, j), steps=4 + j, tokens=(4 + j) * 8 * (j + 1), seq=100 * p + r)  # fmt: skip
                    assert again.status_code == 202, again.text
                    assert again.json()["status"] == "duplicate"
        got = learners[0].fetch(p, newer_than=r, wait=30, have=held[p])
        assert got is not None
        assert got[0] == r + 1
        held[p] = got
    final = {}
    for p in (0, 1):
        got = learners[1].fetch(p)
        assert got is not None
        final[p] = got[1]
        assert held[p][0] == got[0]
        for name, value in got[1].items():  # the updates made every version bit for bit
            np.testing.assert_array_equal(held[p][1][name], value)
    assert learners[0].updates >= updates
    assert status(sync.url)["rounds"] == len(SCHEDULE)
    for learner in learners:
        learner.close()
    return final


@pytest.mark.parametrize("down_codec", ["fp32", "int4"])
def test_kill_9_mid_round_loses_nothing_and_applies_nothing_twice(
    sync_factory: SyncFactory, store: StoreTarget, down_codec: str
) -> None:
    """With compressed downloads (int4) the synchronizer's residual is part of its committed state:
    the versions after a crash are still the same bit for bit."""
    args = [*ARGS, "--down-codec", down_codec]
    updates = len(SCHEDULE) if down_codec != "fp32" else 0
    reference = run_scenario(sync_factory(store.url("reference"), args, store.env), lambda *_: False, updates)

    crashes = {(0, 1, 1), (1, 0, 2)}  # after 2 of 3 contributions; right after the last one

    def crash(sync: SyncProcess, p: int, r: int, i: int) -> bool:
        if (p, r, i) not in crashes:
            return False
        sync.kill9()
        sync.start()
        return True

    sync = sync_factory(store.url("crashed"), args, store.env)
    crashed = run_scenario(sync, crash)
    for p in (0, 1):
        assert crashed[p].keys() == reference[p].keys()
        for name in reference[p]:
            np.testing.assert_array_equal(crashed[p][name], reference[p][name])
    # and the rounds really moved the parameters
    assert not np.array_equal(reference[0]["wte.weight"], initial_params(PLAN, 0, seed=3)["wte.weight"])

    # A restarted synchronizer shows the rounds it merged before, read back from the round logs.
    before = status(sync.url)["recent_rounds"]
    sync.kill9()
    sync.start()
    after = status(sync.url)["recent_rounds"]
    assert [(r["fragment"], r["version"]) for r in after] == [(1, 2), (0, 3), (1, 1), (0, 2), (0, 1)]
    assert after == before
    assert all(sorted(r["participants"]) == ["learner-0", "learner-1", "learner-2"] for r in after)
