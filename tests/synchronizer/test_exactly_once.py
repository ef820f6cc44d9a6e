"""Every step of a learner's progress is merged once, against a real synchronizer process.

The case: one learner, H = 4, K = 1, outer lr 1, no momentum, every inner step moving every
parameter by -1. The merged version of its first send (at step 4) has not reached the learner when
the fragment falls due again (step 8) on the same base version. The learner then sends only the
progress after its first send, so the global model ends where the learner is (-8). A learner that
sends its whole progress from the base again (``since`` 0) is refused: the global model never
takes the first four steps twice (it reached -12 when it did).
"""

from __future__ import annotations

import numpy as np
import pytest
from diloco_core.learner import FragmentCounters, outer_gradient

from tests.synchronizer.conftest import SyncFactory
from tests.synchronizer.helpers import Learner, encode_grad, tiny_plan

pytestmark = pytest.mark.integration
PLAN = tiny_plan(fragments=1, inner_steps=4)
ARGS = [
    "--fragments", "1", "--inner-steps", "4", "--overlap", "1", "--quorum", "1",
    "--outer-lr", "1", "--outer-momentum", "0", "--outer-warmup", "0", "--merge-rule", "mean",
    "--down-codec", "fp32",
]  # fmt: skip
TOKENS = 8


class MinusOneLearner:
    """A learner whose every inner step moves every parameter by -1, with the real counters."""

    def __init__(self, learner: Learner) -> None:
        self.http = learner
        self.params = {t.name: np.zeros(t.shape, np.float32) for t in PLAN.fragments[0].tensors}
        self.anchor = {n: v.copy() for n, v in self.params.items()}
        self.counters = FragmentCounters(PLAN)
        self.counters.set_base(0, 0)

    def step(self) -> list[int]:
        for v in self.params.values():
            v -= 1.0
        self.counters.advance(TOKENS)
        return self.counters.due()

    def send(self, *, whole: bool = False) -> tuple[int, str]:
        """Send fragment 0's progress since the previous send (``whole``: since its base version,
        as a learner that does not track its sends would); the answer's status and code."""
        sent = self.counters.mark_sent(0)
        anchor = self.anchor
        steps, tokens, since = sent.steps, sent.tokens, sent.since
        if whole:
            anchor, steps, tokens, since = self.initial_anchor, sent.through, sent.through * TOKENS, 0
        delta = outer_gradient(anchor, self.params)
        self.anchor = {n: v.copy() for n, v in self.params.items()}
        query = {"base_version": sent.base_version, "steps": steps, "tokens": tokens, "seq": sent.seq}
        if since:
            query["since"] = since
        r = self.http.client.post(
            "/v1/fragments/0/contributions", params=query, content=encode_grad(delta, 0, sent.base_version)
        )
        return r.status_code, r.json().get("code", r.json().get("status"))

    @property
    def initial_anchor(self) -> dict[str, np.ndarray]:
        return {t.name: np.zeros(t.shape, np.float32) for t in PLAN.fragments[0].tensors}


def start(sync_factory: SyncFactory) -> MinusOneLearner:
    sync = sync_factory(args=ARGS)
    http = Learner(sync.url, "learner-0", PLAN, tokens_per_step=TOKENS)
    assert http.register().status_code == 200
    zeros = {t.name: np.zeros(t.shape, np.float32) for t in PLAN.fragments[0].tensors}
    assert http.init(0, zeros).status_code == 200
    return MinusOneLearner(http)


def global_values(learner: MinusOneLearner, newer_than: int) -> tuple[int, dict[str, np.ndarray]]:
    got = learner.http.fetch(0, newer_than=newer_than, wait=30)
    assert got is not None, f"no version newer than {newer_than}"
    return got


def test_a_second_send_on_the_same_base_carries_only_new_progress(sync_factory: SyncFactory) -> None:
    learner = start(sync_factory)
    for step in range(1, 9):
        if learner.step():
            assert learner.send() == (202, "accepted"), step
            # the round merges; its version does not reach the learner before it falls due again
            version, _ = global_values(learner, newer_than=step // 4 - 1)
            assert version == step // 4
    version, values = global_values(learner, newer_than=1)
    assert version == 2
    for name, v in values.items():
        np.testing.assert_array_equal(v, learner.params[name], err_msg=name)
        np.testing.assert_array_equal(v, np.full_like(v, -8.0), err_msg=name)


def test_progress_sent_again_from_the_base_is_refused_once_merged(sync_factory: SyncFactory) -> None:
    learner = start(sync_factory)
    for step in range(1, 9):
        if learner.step():
            answer = learner.send(whole=step > 4)
            if step == 4:
                assert answer == (202, "accepted")
                assert global_values(learner, newer_than=0)[0] == 1
    assert answer == (409, "already_merged")
    assert learner.http.fetch(0, newer_than=1, wait=1) is None  # no second round took it
    version, values = global_values(learner, newer_than=0)
    assert version == 1
    for name, v in values.items():
        np.testing.assert_array_equal(v, np.full_like(v, -4.0), err_msg=name)
