"""The contribution desk in process: the checks in the order a learner can act on, duplicates, and a
learner's newer contribution superseding its pending one."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from diloco_core.protocol import RegisterRequest
from diloco_core.screening import tensors_norm
from diloco_core.uploads import UPLOAD_PREFIX
from diloco_sync.contribution import Sum, held_bytes
from diloco_sync.errors import ApiError

from tests.synchronizer.helpers import encode_grad, encode_params, initial_params, outer_grad
from tests.synchronizer.inprocess import PLAN, in_process


def test_refusals_come_in_the_order_a_learner_can_act_on(tmp_path: Path) -> None:
    sync = in_process(tmp_path, max_staleness=1)

    async def scenario() -> list[tuple[int, str]]:
        def refusal(learner: str, p: int, base: int) -> tuple[int, str]:
            with pytest.raises(ApiError) as info:
                sync.desk.precheck(learner, p, base, 1)
            return info.value.status, info.value.code

        await sync.service.load()
        codes = [refusal("a", 0, 0)]
        await sync.service.register(
            RegisterRequest(learner_id="a", plan=PLAN.to_dict(), plan_hash=PLAN.hash(), tokens_per_step=8)
        )
        codes += [refusal("a", 0, 0), refusal("a", 9, 0)]
        await sync.service.init_fragment(0, encode_params(initial_params(PLAN, 0), 0))
        codes.append(refusal("a", 0, 3))
        assert sync.desk.precheck("a", 0, 0, 1).version == 0
        return codes

    assert asyncio.run(scenario()) == [
        (404, "not_registered"),
        (409, "not_initialised"),
        (404, "unknown_fragment"),
        (409, "stale"),  # a base the fragment has not reached
    ]


def test_a_repeat_is_a_duplicate_and_a_newer_contribution_supersedes_the_pending_one(tmp_path: Path) -> None:
    sync = in_process(tmp_path, quorum=2)

    async def scenario() -> None:
        await sync.start("ab")
        fs = sync.service.fragments.get(0)
        assert await sync.contribute("a", seq=1) == "accepted"
        assert await sync.contribute("a", seq=1) == "duplicate"
        first = sync.pending_objects()
        assert len(first) == 1
        assert await sync.contribute("a", seq=2) == "accepted"
        assert [c.seq for c in fs.pending.values()] == [2]
        assert await sync.contribute("a", seq=1) == "duplicate"  # the superseded one stays answered
        for _ in range(200):  # the superseded copy is deleted in the background
            if first[0] not in sync.pending_objects():
                break
            await asyncio.sleep(0.01)
        assert len(sync.pending_objects()) == 1
        assert first[0] not in sync.pending_objects()
        assert sync.service.traffic.bytes_in > 0

    asyncio.run(scenario())


def test_a_contribution_the_merging_round_would_make_stale_is_refused_not_accepted_then_dropped(
    tmp_path: Path,
) -> None:
    """max_staleness 0: while version 1 is being merged, a contribution on version 0 can only join the
    round on version 1, where it is stale; it is refused at once, never answered 202 and then excluded."""
    sync = in_process(tmp_path, quorum=1, max_staleness=0, grace_gamma=0.0)

    async def scenario() -> None:
        await sync.start("ab")
        fs = sync.service.fragments.get(0)
        assert await sync.contribute("a") == "accepted"
        sync.runner.tick()  # the merge of version 1 starts (its task has not run yet)
        assert fs.phase == "merging"
        with pytest.raises(ApiError) as info:
            await sync.contribute("b")
        assert (info.value.status, info.value.code) == (409, "stale")
        assert "being merged" in info.value.body.reason
        for _ in range(500):
            await asyncio.sleep(0.01)
            if fs.phase == "open":
                break
        assert fs.version == 1
        assert not fs.pending
        assert await sync.contribute("b", base=1) == "accepted"  # from the new version it counts

    asyncio.run(scenario())


def test_a_learner_s_many_parts_are_added_up_once_they_hold_more_than_twice_their_sum(tmp_path: Path) -> None:
    """Five fp32 parts of one learner's progress, each as large as their sum in float32: the third
    and the fifth make the pending sum hold more than twice that, so it is added up into float32
    arrays, bit for bit the parts added in order, with its norm; the parts' own tensors are
    dropped; the round merges it."""
    sync = in_process(tmp_path, quorum=1)
    grads = [outer_grad(PLAN, 0, seed=10 + i) for i in range(5)]
    dense = 4 * PLAN.fragments[0].numel

    async def scenario() -> None:
        await sync.start("a")
        fs = sync.service.fragments.get(0)
        held = []
        for i, g in enumerate(grads):
            result = await sync.send(
                "a", 0, encode_grad(g, 0, 0), base_version=0, steps=4, tokens=32, seq=i + 1, since=4 * i
            )
            assert result.status == "accepted"
            held.append(held_bytes(fs.pending["a"].tensors))
        assert held == [dense, 2 * dense, dense, 2 * dense, dense]
        c = fs.pending["a"]
        assert not isinstance(c.tensors, Sum)
        assert (c.since, c.through, c.steps, len(c.parts)) == (0, 20, 20, 4)
        assert all(dict(part.tensors) == {} for part in c.parts)
        for name, value in c.tensors.items():
            expected = grads[0][name].copy()
            for g in grads[1:]:
                expected += g[name]
            np.testing.assert_array_equal(value, expected)
        assert c.norm == tensors_norm(c.tensors)
        sync.runner.tick()
        assert await fs.wait_newer(0, 5.0) == "version"

    asyncio.run(scenario())


def test_a_body_whose_pending_object_cannot_be_stored_is_held_in_memory_then_written(tmp_path: Path) -> None:
    """The body is written where its pending object goes; when storing it fails (here a folder stands
    where the object goes, a real failure of the rename), the contribution is answered durable: false,
    held in memory, storage is marked down, and the object is written once storage takes it again."""
    sync = in_process(tmp_path, quorum=2)

    async def scenario() -> None:
        await sync.start("ab")
        key = sync.service.store.layout.pending(0, "a", 0, 1)
        (tmp_path / key).mkdir(parents=True)
        result = await sync.send(
            "a", 0, encode_grad(outer_grad(PLAN, 0, seed=1), 0, 0), base_version=0, seq=1, steps=4, tokens=32
        )
        assert (result.status, result.durable) == ("accepted", False)
        assert not sync.desk.guard.ok
        held = sync.service.fragments.get(0).pending["a"]
        assert held.blob is not None
        assert held.storage_key is None
        assert upload_files(tmp_path) == []
        (tmp_path / key).rmdir()
        await sync.desk.flush()
        assert held.storage_key == key
        assert sync.pending_objects() == [key]

    asyncio.run(scenario())


def test_a_restart_removes_the_bodies_a_crash_left_half_written(tmp_path: Path) -> None:
    first = in_process(tmp_path, quorum=2)

    async def crash_while_receiving() -> None:
        await first.start("ab")
        body = first.desk.open_body("a", 0, 0, 1)  # a body arriving when the process dies
        body.write(b"part of a payload")
        await first.contribute("b", seq=1)

    asyncio.run(crash_while_receiving())
    assert len(upload_files(tmp_path)) == 1
    again = in_process(tmp_path, quorum=2)
    asyncio.run(again.service.load())
    assert upload_files(tmp_path) == []
    assert again.pending_objects() == [again.service.store.layout.pending(0, "b", 0, 1)]  # taken ones stay


def test_parts_read_back_with_a_lost_one_between_them_wait_for_it_and_every_step_is_merged(
    tmp_path: Path,
) -> None:
    """Learner a's three parts (steps 1-4, 5-8, 9-12) are stored, except the second, which was only
    held in memory when the process died (its object is removed here). The restarted synchronizer
    reads back the first and the third: the third waits behind the gap instead of being added to the
    first over it, the learner's resend of the second is taken and joins them, and the round merges
    all twelve steps."""
    first = in_process(tmp_path, quorum=2)
    grads = [outer_grad(PLAN, 0, seed=20 + i) for i in range(3)]

    async def send_all() -> None:
        await first.start("ab")
        for i, g in enumerate(grads):
            result = await first.send(
                "a", 0, encode_grad(g, 0, 0), base_version=0, steps=4, tokens=32, seq=i + 1, since=4 * i
            )
            assert (result.status, result.durable) == ("accepted", True)

    asyncio.run(send_all())
    lost = first.service.store.layout.pending(0, "a", 0, 2)
    first.service.store.store.delete(lost)
    again = in_process(tmp_path, quorum=2)

    async def after_the_restart() -> None:
        again.desk.replay(await again.service.load())
        fs = again.service.fragments.get(0)
        head = fs.pending["a"]
        assert (head.since, head.through, head.steps) == (0, 4, 4)
        assert [(w.since, w.through) for w in fs.waiting["a"]] == [(8, 12)]
        resent = await again.send(
            "a", 0, encode_grad(grads[1], 0, 0), base_version=0, steps=4, tokens=32, seq=2, since=4
        )
        assert (resent.status, resent.durable) == ("accepted", True)
        whole = fs.pending["a"]
        assert (whole.since, whole.through, whole.steps, whole.tokens, fs.waiting) == (0, 12, 12, 96, {})
        for name, value in whole.tensors.items():
            np.testing.assert_array_equal(value, (grads[0][name] + grads[1][name]) + grads[2][name])
        assert await again.contribute("b", seq=1) == "accepted"
        again.runner.tick()
        assert await fs.wait_newer(0, 5.0) == "version"
        assert fs.merged_through["a"] == (0, 12)

    asyncio.run(after_the_restart())


def upload_files(root: Path) -> list[Path]:
    """The upload files under the pending folders of ``root`` (other objects' writes make their own
    temporary files for a moment)."""
    return [path for path in root.glob(f"*/pending/**/{UPLOAD_PREFIX}*") if path.is_file()]
