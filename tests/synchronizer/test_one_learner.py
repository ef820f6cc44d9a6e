"""What one learner with a valid token cannot do to the others, against a real synchronizer process:
freeze a fragment with continuations whose sum is beyond the bounds, have progress merged twice by
replaying it on an older base, jump its progress ahead of what the synchronizer holds, or use a
request read off another learner's link."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from diloco_core.auth import learner_token
from diloco_core.bounds import MAX_TOKENS
from diloco_core.protocol import LEARNER_HEADER

from tests.synchronizer.conftest import SyncFactory
from tests.synchronizer.helpers import (
    SECRET,
    Learner,
    SyncProcess,
    encode_grad,
    initial_params,
    outer_grad,
    status,
    tiny_plan,
)

pytestmark = pytest.mark.integration
PLAN = tiny_plan(fragments=1)
ARGS = ["--fragments", "1", "--inner-steps", "4", "--overlap", "1", "--merge-rule", "mean"]


def joined(sync: SyncProcess, *names: str) -> list[Learner]:
    learners = [Learner(sync.url, name, PLAN) for name in names]
    for learner in learners:
        assert learner.register().status_code == 200
        assert learner.heartbeat(4).status_code == 200
    assert learners[0].init(0, initial_params(PLAN, 0)).status_code == 200
    return learners


def grad(seed: int, base: int) -> bytes:
    return encode_grad(outer_grad(PLAN, 0, seed=seed), 0, base)


def test_continuations_whose_sum_is_beyond_the_bounds_are_refused_and_the_honest_ones_merge(
    sync_factory: SyncFactory,
) -> None:
    sync = sync_factory(args=[*ARGS, "--quorum", "3", "--min-step-time-s", "0"])  # the fold's bounds alone
    a, b, x = joined(sync, "a", "b", "x")
    claim = {"steps": 10**8, "tokens": MAX_TOKENS}  # each within the bounds of one contribution
    assert x.contribute(0, 0, grad(1, 0), since=0, **claim).status_code == 202
    refused = x.contribute(0, 0, grad(2, 0), since=10**8, **claim)
    assert refused.status_code == 400, refused.text
    assert "beyond the bounds of one contribution" in refused.json()["reason"]
    for learner, seed in ((a, 3), (b, 4)):
        assert learner.contribute(0, 0, grad(seed, 0)).json()["status"] == "accepted"
    assert a.fetch(0, newer_than=0, wait=30) is not None
    fragment = status(sync.url)["fragments"][0]  # type: ignore[index]
    assert (fragment["version"], fragment["excluded"]) == (1, 0)
    merged = status(sync.url)["recent_rounds"][0]  # type: ignore[index]
    held = dict(zip(merged["participants"], zip(merged["steps"], merged["tokens"], strict=True), strict=True))
    assert held == {"a": (4, 32), "b": (4, 32), "x": (10**8, MAX_TOKENS)}  # the status says what was merged


def test_progress_replayed_on_an_older_base_is_not_merged_a_second_time(sync_factory: SyncFactory) -> None:
    sync = sync_factory(args=[*ARGS, "--quorum", "1", "--outer-lr", "1", "--outer-momentum", "0"])
    (a,) = joined(sync, "a")
    blob = grad(1, 0)
    assert a.contribute(0, 0, blob, seq=1).json()["status"] == "accepted"
    assert a.fetch(0, newer_than=0, wait=30) is not None
    assert a.contribute(0, 1, grad(2, 1), seq=2).json()["status"] == "accepted"
    got = a.fetch(0, newer_than=1, wait=30)
    assert got is not None
    replay = a.contribute(0, 0, blob, seq=3)  # the first progress again, under a new sequence number
    assert replay.status_code == 409, replay.text
    assert replay.json()["code"] == "already_merged"
    assert a.fetch(0, newer_than=2, wait=2) is None  # no round took it
    version, values = a.fetch(0, newer_than=-1) or (None, {})
    assert version == 2
    for name, v in values.items():
        np.testing.assert_array_equal(v, got[1][name], err_msg=name)


def test_a_part_that_jumps_ahead_of_the_progress_held_is_refused(sync_factory: SyncFactory) -> None:
    sync = sync_factory(args=[*ARGS, "--quorum", "2"])
    a, _ = joined(sync, "a", "b")
    ahead = a.contribute(0, 0, grad(1, 0), since=10**12 - 4)
    assert ahead.status_code == 409, ahead.text
    assert (ahead.json()["code"], "held through step 0" in ahead.json()["reason"]) == ("out_of_order", True)
    assert a.contribute(0, 0, grad(2, 0), since=0).json()["status"] == "accepted"
    skips = a.contribute(0, 0, grad(3, 0), since=8)  # steps 5-8 were never sent
    assert (skips.status_code, skips.json()["code"]) == (409, "out_of_order")
    assert a.contribute(0, 0, grad(4, 0), since=4).json()["status"] == "accepted"
    assert status(sync.url)["fragments"][0]["pending"] == 1  # type: ignore[index]


def test_more_steps_than_the_versions_age_allows_are_refused_across_a_restart(
    sync_factory: SyncFactory,
) -> None:
    """At most 2 H steps plus (age + 5 s) / --min-step-time-s on a version, whenever the claim comes:
    the versions' commit times are in the manifest."""
    sync = sync_factory(args=[*ARGS, "--quorum", "2", "--min-step-time-s", "0.01"])
    a, b = joined(sync, "a", "b")
    fast = a.contribute(0, 0, grad(1, 0), steps=10**6, tokens=8 * 10**6)
    assert fast.status_code == 400, fast.text
    assert "--min-step-time-s" in fast.json()["reason"]
    sync.stop()
    sync.start()
    for learner in (a, b):
        assert learner.register().status_code == 200
    again = a.contribute(0, 0, grad(2, 0), steps=10**6, tokens=8 * 10**6)
    assert again.status_code == 400, again.text
    assert a.contribute(0, 0, grad(3, 0), steps=8).json()["status"] == "accepted"


def test_a_unit_declared_slower_than_the_job_is_held_to_its_own_pace(sync_factory: SyncFactory) -> None:
    """The step time a learner's token declares for its unit (the operator mints it from the unit's
    minStepTimeSeconds) bounds its steps where it is slower than the job's; a faster one loosens
    nothing."""
    sync = sync_factory(args=[*ARGS, "--quorum", "2", "--min-step-time-s", "0.01"])
    a, b = joined(sync, "a", "b")
    slow = Learner(sync.url, "slow", PLAN, claims={"min_step_s": 1.0})
    quick = Learner(sync.url, "quick", PLAN, claims={"min_step_s": 0.0001})
    for learner in (slow, quick):
        assert learner.register().status_code == 200
    # 200 steps on version 0, seconds after it was made: within 2 H + (age + 5 s) / 0.01, far beyond
    # 2 H + (age + 5 s) / 1.0
    assert a.contribute(0, 0, grad(1, 0), steps=200).json()["status"] == "accepted"
    refused = slow.contribute(0, 0, grad(2, 0), steps=200)
    assert refused.status_code == 400, refused.text
    assert "at 1 s per step (its unit's minStepTimeSeconds, in its token)" in refused.json()["reason"]
    assert slow.contribute(0, 0, grad(3, 0), steps=4).json()["status"] == "accepted"
    beyond = quick.contribute(0, 0, grad(4, 0), steps=10**6, tokens=8 * 10**6)
    assert beyond.status_code == 400, beyond.text
    assert "--min-step-time-s" in beyond.json()["reason"]


def test_what_is_read_off_a_learners_link_is_not_good_for_another_request(sync_factory: SyncFactory) -> None:
    """A learner's requests carry a proof signed with its token, never the token: a request read off
    the link (plain HTTP here) is refused when sent again, and its proof is refused on the learner's
    leave route or with other query values; the whole token as a bearer is refused too. Before
    requests were signed, the captured bearer token made any of these (a leave: 204)."""
    sync = sync_factory(args=[*ARGS, "--quorum", "2"])
    (a,) = joined(sync, "a")
    sent = a.contribute(0, 0, grad(1, 0), steps=4)
    assert sent.status_code == 202, sent.text
    captured = {"Authorization": sent.request.headers["authorization"], LEARNER_HEADER: "a"}
    assert learner_token(SECRET, "a").rsplit(".", 1)[1] not in captured["Authorization"]
    route = str(sent.request.url)
    again = httpx.post(route, content=grad(1, 0), headers=captured)
    leave = httpx.post(f"{sync.url}/v1/learners/a/leave", headers=captured)
    more = httpx.post(route.replace("steps=4", "steps=8"), content=grad(1, 0), headers=captured)
    bearer = {**captured, "Authorization": f"Bearer {learner_token(SECRET, 'a')}"}
    whole = httpx.post(f"{sync.url}/v1/learners/a/leave", headers=bearer)
    for refused in (again, leave, more, whole):
        assert refused.status_code == 401, refused.text
    assert "received before" in again.json()["reason"]
    assert "not this request's" in leave.json()["reason"]
    assert "bearer token is not accepted" in whole.json()["reason"]
    assert a.heartbeat(8).status_code == 200  # the learner never left, and its own requests go on
    (entry,) = [x for x in status(sync.url)["learners"] if x["learner_id"] == "a"]  # type: ignore[union-attr]
    assert entry["state"] != "left"


def test_a_request_read_off_the_link_is_not_good_at_the_restarted_synchronizer(
    sync_factory: SyncFactory,
) -> None:
    """A proof is signed for the synchronizer process it is sent to (the instance its challenge
    names): once the synchronizer is killed and restarted, a contribution read off the link before is
    refused (401), where it was taken as a duplicate before proofs named the process, and a captured
    heartbeat with a forged body is refused too. The learner's own client signs for the new process
    after one challenge and is served."""
    sync = sync_factory(args=[*ARGS, "--quorum", "2"])
    (a,) = joined(sync, "a")
    sent = a.contribute(0, 0, grad(1, 0), steps=4)
    assert sent.status_code == 202, sent.text
    beat = a.heartbeat(4)
    assert beat.status_code == 200, beat.text
    captured = {"Authorization": sent.request.headers["authorization"], LEARNER_HEADER: "a"}
    captured_beat = {"Authorization": beat.request.headers["authorization"], LEARNER_HEADER: "a"}
    sync.kill9()
    sync.start()
    again = httpx.post(str(sent.request.url), content=grad(1, 0), headers=captured)
    forged = {"step": 4, "tokens": 32, "step_time_s": 86_400.0}
    slow = httpx.post(str(beat.request.url), json=forged, headers=captured_beat)
    for refused in (again, slow):
        assert refused.status_code == 401, refused.text
        assert "not for this synchronizer process" in refused.json()["reason"]
        assert refused.headers["WWW-Authenticate"].startswith('DiLoCo-Proof instance="')
    assert a.heartbeat(8).status_code == 200  # its own client signs for the restarted process


def scaled(seed: int, norm: float) -> dict[str, np.ndarray]:
    """An outer gradient of exactly (to float32) this norm."""
    g = outer_grad(PLAN, 0, seed=seed)
    total = np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in g.values()))
    return {name: (v * (norm / total)).astype(np.float32) for name, v in g.items()}


def params_norm(values: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in values.values())))


def test_an_adversarial_learner_moves_the_model_by_at_most_the_bound_across_a_restart(
    sync_factory: SyncFactory,
) -> None:
    """An honest learner sends norm 1 each round; one with every weight it may claim sends 9 (inside
    the limit of 10 x the lower median), then 11, then after a kill -9 five times the parameters'
    norm. The global model moves at most 10 per round (outer lr 1, no momentum), the limit never
    ratchets up (11 is clipped to 10 after 12 rounds at 9), and the restart does not reopen the window
    (the 5x is clipped too)."""
    args = [
        *ARGS,
        "--quorum",
        "2",
        "--outer-lr",
        "1",
        "--outer-momentum",
        "0",
        "--outer-warmup",
        "0",
        "--down-codec",
        "fp32",
        "--max-update-norm-factor",
        "10",
    ]
    sync = sync_factory(args=args)
    h, x = joined(sync, "h", "x")
    heavy = {"steps": 4, "tokens": 4 * 10**9}  # the most tokens per step a learner may claim

    def round_with(version: int, x_norm: float, seed: int) -> tuple[int, dict[str, np.ndarray]]:
        assert h.contribute(0, version, encode_grad(scaled(seed, 1.0), 0, version)).status_code == 202
        assert (
            x.contribute(0, version, encode_grad(scaled(seed + 1, x_norm), 0, version), **heavy).status_code
            == 202
        )
        got = h.fetch(0, newer_than=version, wait=30)
        assert got is not None, f"no round after version {version}"
        return got

    version, values = 0, initial_params(PLAN, 0)
    for i in range(2):  # a history of honest-looking norms
        version, values = round_with(version, 1.0, 10 * i)
    for i in range(12):  # at 9x: merged, and its weight makes the merged update its own
        before = values
        version, values = round_with(version, 9.0, 100 + 10 * i)
        moved = params_norm({n: values[n] - before[n] for n in values})
        assert moved <= 10.0 * (1 + 1e-5), f"round {version}: moved {moved}"
    clipped = status(sync.url)["fragments"][0]["clipped"]  # type: ignore[index]
    before = values
    version, values = round_with(version, 11.0, 999)  # above 10 x the honest norm: the limit did not grow
    assert status(sync.url)["fragments"][0]["clipped"] == clipped + 1  # type: ignore[index]
    newest = status(sync.url)["recent_rounds"][0]  # type: ignore[index]
    assert (newest["participants"], newest["excluded"]) == (["h", "x"], [])  # type: ignore[index]
    (why,) = newest["clipped"]  # type: ignore[index]
    assert why["learner"] == "x"
    assert "above the limit" in why["reason"]
    assert "merged at the limit" in why["reason"]
    assert params_norm({n: values[n] - before[n] for n in values}) <= 10.0 * (1 + 1e-5)
    sync.kill9()
    sync.start()
    for learner in (h, x):
        assert learner.register().status_code == 200
        assert learner.heartbeat(4).status_code == 200
    before = values
    version, values = round_with(version, 5.0 * params_norm(values), 2024)
    assert status(sync.url)["fragments"][0]["clipped"] == 1  # type: ignore[index]  # since the restart
    moved = params_norm({n: values[n] - before[n] for n in values})
    assert moved <= 10.0 * (1 + 1e-5)
