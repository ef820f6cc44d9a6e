"""Learner-side state: outer gradient, applying a global version, per-fragment counters."""

from __future__ import annotations

import numpy as np
import pytest
from diloco_core.fragments import build_plan
from diloco_core.learner import FragmentCounter, FragmentCounters, apply_global, outer_gradient


def test_outer_gradient_is_anchor_minus_params() -> None:
    anchor = {"w": np.array([1.0, 2.0], np.float32)}
    params = {"w": np.array([0.5, 3.0], np.float32)}
    np.testing.assert_array_equal(outer_gradient(anchor, params)["w"], [0.5, -1.0])
    with pytest.raises(ValueError, match="different tensors"):
        outer_gradient(anchor, {"v": params["w"]})


def test_apply_global_mixes_with_alpha() -> None:
    local = {"w": np.array([0.0, 4.0], np.float32)}
    glob = {"w": np.array([2.0, 0.0], np.float32)}
    out = apply_global(local, glob, 0.0)
    np.testing.assert_array_equal(out["w"], glob["w"])
    assert out["w"] is not glob["w"]
    np.testing.assert_allclose(apply_global(local, glob, 0.5)["w"], [1.0, 2.0])
    with pytest.raises(ValueError, match="alpha"):
        apply_global(local, glob, 1.5)


def test_counters_make_fragments_fall_due_at_different_steps() -> None:
    plan = build_plan([(f"h.{i}.w", (4,)) for i in range(4)], num_fragments=4, inner_steps=8, overlap=1)
    counters = FragmentCounters(plan)
    counters.set_base(0, 3)
    assert [c.steps for c in counters] == [0, -2, -4, -6]
    assert counters.versions() == {0: 3, 1: -1, 2: -1, 3: -1}
    due_at: dict[int, int] = {}
    for step in range(1, 15):
        counters.advance(tokens=100)
        for p in counters.due():
            due_at.setdefault(p, step)
    assert due_at == {0: 8, 1: 10, 2: 12, 3: 14}
    # tokens count only steps after the counter passed zero, so tokens / steps is tokens per step
    assert counters[0].tokens == 14 * 100
    assert counters[3].tokens == 8 * 100
    counters.reset(0, base_version=4)
    assert (counters[0].steps, counters[0].tokens, counters[0].base_version) == (0, 0, 4)
    with pytest.raises(IndexError):
        counters.reset(9, 1)
    with pytest.raises(ValueError, match="tokens"):
        counters.advance(-1)


def test_a_sent_fragment_falls_due_again_h_steps_after_the_send_until_a_version_arrives() -> None:
    plan = build_plan([("h.0.w", (4,)), ("h.1.w", (4,))], num_fragments=2, inner_steps=4, overlap=1)
    counters = FragmentCounters(plan)  # offsets 0 and 2
    due_at: dict[int, list[int]] = {0: [], 1: []}
    for step in range(1, 13):
        counters.advance(10)
        for p in counters.due():
            due_at[p].append(step)
            sent = counters.mark_sent(p)  # no global version comes back
            # each send carries only the 4 steps (and their tokens) after the previous one
            assert (sent.since, sent.steps, sent.tokens, sent.seq) == (
                counters[p].sent_at - 4 if due_at[p][1:] else 0,
                4,
                40,
                len(due_at[p]),
            )
            assert counters[p].sent_at == sent.through
    assert due_at == {0: [4, 8, 12], 1: [6, 10]}
    assert not counters.unsent(0)  # sent at step 12, nothing since
    counters.advance(10)
    assert counters.unsent(0)
    counters.reset(0, base_version=1)
    assert (counters[0].sent_at, counters[0].seq) == (0, 3)  # the sequence goes on across versions
    assert not counters.unsent(0)


def test_counters_round_trip_through_their_checkpoint_form() -> None:
    plan = build_plan([("h.0.w", (4,)), ("h.1.w", (4,))], num_fragments=2, inner_steps=4, overlap=1)
    counters = FragmentCounters(plan)
    for _ in range(5):
        counters.advance(7)
    counters.mark_sent(0)
    meta = counters.to_list()
    assert meta[0] == {
        "base_version": -1,
        "steps": 5,
        "tokens": 35,
        "sent_at": 5,
        "sent_tokens": 35,
        "seq": 1,
        "since_send": 0,
    }
    again = FragmentCounters.from_list(plan, meta)
    assert again.to_list() == meta
    assert FragmentCounters.from_list(plan, [{"steps": 2}, {}])[0] == FragmentCounter(steps=2)
    with pytest.raises(ValueError, match="malformed"):
        FragmentCounters.from_list(plan, [{"steps": 1, "colour": 3}, {}])
    with pytest.raises(ValueError, match="1 fragment counters for a plan of 2"):
        FragmentCounters.from_list(plan, meta[:1])


def _due_steps(counters: FragmentCounters, steps: int, arrivals: dict[int, int]) -> dict[int, list[int]]:
    """Run ``steps`` inner steps; fragment p's new version arrives ``arrivals[p]`` steps after each send."""
    due: dict[int, list[int]] = {p: [] for p in range(len(counters))}
    arrive_at: dict[int, int] = {}
    for t in range(1, steps + 1):
        counters.advance(10)
        for p, at in list(arrive_at.items()):
            if at == t:
                counters.reset(p, counters[p].base_version + 1)
                del arrive_at[p]
        for p in counters.due():
            counters.mark_sent(p)
            due[p].append(t)
            arrive_at[p] = t + arrivals[p]
    return due


def test_the_after_version_schedule_sends_h_steps_after_the_new_version_arrived() -> None:
    plan = build_plan([("h.0.w", (4,)), ("h.1.w", (4,))], num_fragments=2, inner_steps=4, overlap=1)
    due = _due_steps(FragmentCounters(plan, schedule="after-version"), 20, arrivals={0: 2, 1: 2})
    assert due == {0: [4, 10, 16], 1: [6, 12, 18]}  # period H + delay = 6


def test_the_default_schedule_sends_at_t_mod_h_equal_to_the_offset_whatever_the_delay() -> None:
    plan = build_plan([("h.0.w", (4,)), ("h.1.w", (4,))], num_fragments=2, inner_steps=4, overlap=1)
    due = _due_steps(FragmentCounters(plan), 20, arrivals={0: 2, 1: 2})
    assert due == {0: [4, 8, 12, 16, 20], 1: [6, 10, 14, 18]}  # offsets 0 and 2, period H
    # a version that arrives after the next due step: the send there carries the progress since the
    # previous send on the same base (nothing is sent twice)
    counters = FragmentCounters(plan, schedule="fixed")
    for _ in range(4):
        counters.advance(10)
    assert counters.due() == [0]
    first = counters.mark_sent(0)
    for _ in range(4):
        counters.advance(10)
    assert counters.due() == [0]
    second = counters.mark_sent(0)
    assert (first.since, first.steps, second.since, second.steps) == (0, 4, 4, 4)
    # a version that arrives exactly at a due step leaves nothing to send there: the next send is
    # one period later, not at the next step
    counters = FragmentCounters(plan, schedule="fixed")
    for t in range(1, 13):
        counters.advance(10)
        if t == 8:
            counters.reset(0, 1)
        if 0 in counters.due():
            assert t in (4, 12), t
            counters.mark_sent(0)
    with pytest.raises(ValueError, match="schedule"):
        FragmentCounters(plan, schedule="sometimes")  # type: ignore[arg-type]
