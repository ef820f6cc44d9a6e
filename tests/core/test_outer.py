"""The outer optimizer against torch.optim.SGD, Delayed Nesterov, state round trips, and state that is
never edited in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diloco_core import codec
from diloco_core.outer import NESTEROV_LOOP, OuterOptimizer, OuterState, delayed_segments

from tests.core.loops import PATHS, take_path

Arrays = dict[str, np.ndarray]


@pytest.fixture(autouse=True, params=PATHS)
def loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here runs on the numpy code and on the compiled Nesterov loop, which must give the
    same bits."""
    take_path(request, monkeypatch, NESTEROV_LOOP)


def run(
    opt: OuterOptimizer, state: OuterState, theta: Arrays, delta: Arrays, count: int = 1
) -> tuple[Arrays, OuterState]:
    params, new = opt.step(state, theta, delta, count)
    return dict(params), new


@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_sgd_with_momentum(nesterov: bool) -> None:
    rng = np.random.default_rng(0)
    theta = {
        "w": rng.standard_normal((4, 3)).astype(np.float32),
        "b": rng.standard_normal(3).astype(np.float32),
    }
    ref = {n: torch.nn.Parameter(torch.from_numpy(v.copy())) for n, v in theta.items()}
    sgd = torch.optim.SGD(list(ref.values()), lr=0.7, momentum=0.9, nesterov=nesterov)
    opt, state = OuterOptimizer(lr=0.7, momentum=0.9, nesterov=nesterov), OuterState()
    for _ in range(5):
        delta = {n: rng.standard_normal(v.shape).astype(np.float32) for n, v in theta.items()}
        for n, p in ref.items():
            p.grad = torch.from_numpy(delta[n])
        sgd.step()
        theta, state = run(opt, state, theta, delta)
        for n, p in ref.items():
            np.testing.assert_allclose(theta[n], p.detach().numpy(), rtol=1e-6, atol=1e-6)
    assert state.steps == 5


@pytest.mark.parametrize("nesterov", [True, False])
def test_a_step_is_its_formula_in_float32_bit_for_bit_whatever_the_tensor_size(nesterov: bool) -> None:
    rng = np.random.default_rng(7)
    theta = {
        "w": rng.standard_normal((300, 701)).astype(np.float32),  # several chunks and a partial one
        "b": rng.standard_normal(3).astype(np.float32),
        "s": np.array(0.5, dtype=np.float32),
        "e": np.zeros((0, 4), dtype=np.float32),
    }
    opt, state = OuterOptimizer(lr=0.7, momentum=0.9, nesterov=nesterov), OuterState()
    mu, lr = np.float32(0.9), np.float32(0.7)
    u: Arrays = {}
    for _ in range(3):
        delta = {n: rng.standard_normal(v.shape).astype(np.float32) for n, v in theta.items()}
        params, state = run(opt, state, theta, delta)
        for n, d in delta.items():
            u[n] = d.copy() if n not in u else u[n] * mu + d
            g = d + mu * u[n] if nesterov else u[n]
            expected = theta[n] - lr * g
            assert params[n].shape == expected.shape
            np.testing.assert_array_equal(params[n].view(np.uint32), expected.view(np.uint32))
            np.testing.assert_array_equal(state.momentum[n].view(np.uint32), u[n].view(np.uint32))
        theta = params


def test_a_step_returns_new_state_and_leaves_the_old_one_as_it_was() -> None:
    rng = np.random.default_rng(4)
    theta = {"w": rng.standard_normal(5).astype(np.float32)}
    for opt in (OuterOptimizer(), OuterOptimizer(delayed_every=2)):
        _, state = run(opt, OuterState(), theta, {"w": rng.standard_normal(5).astype(np.float32)})
        before = {k: v.copy() for k, v in state.to_arrays().items()}
        delta = {"w": rng.standard_normal(5).astype(np.float32)}
        first, after = run(opt, state, theta, delta)
        for key, value in state.to_arrays().items():
            np.testing.assert_array_equal(value, before[key])
        assert after.steps == state.steps + 1
        # the same inputs give the same step: a failed round simply drops its result
        again, _ = run(opt, state, theta, delta)
        np.testing.assert_array_equal(first["w"], again["w"])
        with pytest.raises(ValueError, match="read-only"):
            next(iter(after.momentum.values() or after.buffer.values()))[0] = 1.0


def test_delayed_nesterov_applies_momentum_every_n_steps() -> None:
    opt, state = OuterOptimizer(lr=1.0, momentum=0.5, delayed_every=2), OuterState()
    theta = {"w": np.zeros(1, np.float32)}
    g1, g2, g3 = (np.array([v], np.float32) for v in (2.0, 4.0, 6.0))
    theta, state = run(opt, state, theta, {"w": g1})  # no momentum yet: theta -= g/N
    np.testing.assert_allclose(theta["w"], [-1.0])
    theta, state = run(opt, state, theta, {"w": g2})  # u = (2 + 4) / 2 = 3; theta -= 0.5 * 3 + 4 / 2
    np.testing.assert_allclose(theta["w"], [-1.0 - 1.5 - 2.0])
    theta, state = run(opt, state, theta, {"w": g3})  # momentum kept, not applied: theta -= 6 / 2
    np.testing.assert_allclose(theta["w"], [-4.5 - 3.0])


def test_state_survives_a_codec_round_trip_and_continues_identically() -> None:
    rng = np.random.default_rng(1)
    theta = {"w": rng.standard_normal(5).astype(np.float32)}
    deltas = [{"w": rng.standard_normal(5).astype(np.float32)} for _ in range(4)]
    for delayed in (0, 3):
        opt, a = OuterOptimizer(delayed_every=delayed), OuterState()
        ta = dict(theta)
        for d in deltas[:2]:
            ta, a = run(opt, a, ta, d)
        blob = codec.encode(a.to_arrays(), fragment=0, base_version=0, kind="params", quantizer="fp32")
        b = OuterState.from_arrays(codec.decode(blob).tensors)
        tb = dict(ta)
        for d in deltas[2:]:
            ta, a = run(opt, a, ta, d)
            tb, b = run(opt, b, tb, d)
        np.testing.assert_array_equal(ta["w"], tb["w"])
        assert b.steps == 4


def test_the_state_of_a_scalar_tensor_handed_over_keeps_its_shape_and_continues() -> None:
    opt = OuterOptimizer()
    theta = {"s": np.array(0.5, np.float32), "w": np.ones(3, np.float32)}
    delta = {"s": np.array(0.25, np.float32), "w": np.full(3, 0.125, np.float32)}
    theta, state = opt.step(OuterState(), theta, delta)
    blob = codec.encode(state.to_arrays(), fragment=0, base_version=0, kind="params", quantizer="fp32")
    back = OuterState.from_arrays(codec.decode(blob).tensors, given=True)
    assert back.momentum["s"].shape == ()
    np.testing.assert_array_equal(opt.step(back, theta, delta)[0]["s"], opt.step(state, theta, delta)[0]["s"])


def test_bad_input_is_refused() -> None:
    opt, state = OuterOptimizer(), OuterState()
    with pytest.raises(ValueError, match="different tensors"):
        opt.step(state, {"a": np.zeros(1, np.float32)}, {"b": np.zeros(1, np.float32)})
    with pytest.raises(ValueError, match="params"):
        opt.step(state, {"a": np.zeros(1, np.float32)}, {"a": np.zeros(2, np.float32)})
    # a momentum of another shape than its tensor (a state of another model), on both paths
    held = OuterState(1, {"a": np.zeros(10, np.float32)})
    with pytest.raises(ValueError, match="tensor 'a': momentum \\(10,\\) vs params \\(1000,\\)"):
        opt.step(held, {"a": np.ones(1000, np.float32)}, {"a": np.ones(1000, np.float32)})
    with pytest.raises(ValueError, match="tensor 'a': delayed buffer \\(2, 5\\) vs params \\(10,\\)"):
        OuterOptimizer(delayed_every=2).step(
            OuterState(1, buffer={"a": np.zeros((2, 5), np.float32)}),
            {"a": np.ones(10, np.float32)},
            {"a": np.ones(10, np.float32)},
        )
    with pytest.raises(ValueError, match="unknown outer optimizer state key"):
        OuterState.from_arrays({"nope": np.zeros(1, np.float32)})
    with pytest.raises(ValueError, match="bad outer optimizer settings"):
        OuterOptimizer(momentum=1.0)


def test_delayed_nesterov_every_step_is_plain_nesterov() -> None:
    rng = np.random.default_rng(2)
    plain, delayed = OuterOptimizer(), OuterOptimizer(delayed_every=1)
    sa = sb = OuterState()
    ta = tb = {"w": rng.standard_normal(6).astype(np.float32)}
    for _ in range(4):
        d = {"w": rng.standard_normal(6).astype(np.float32)}
        ta, sa = run(plain, sa, ta, d)
        tb, sb = run(delayed, sb, tb, d)
        np.testing.assert_allclose(ta["w"], tb["w"], rtol=1e-6, atol=1e-7)


def test_delayed_nesterov_merging_all_n_at_once_is_plain_nesterov() -> None:
    # a round that merges every one of the N learners is one synchronous DiLoCo outer step
    rng = np.random.default_rng(3)
    plain, delayed = OuterOptimizer(), OuterOptimizer(delayed_every=4)
    sa = sb = OuterState()
    ta = tb = {"w": rng.standard_normal(6).astype(np.float32)}
    for _ in range(3):
        d = {"w": rng.standard_normal(6).astype(np.float32)}
        ta, sa = run(plain, sa, ta, d)
        tb, sb = run(delayed, sb, tb, d, count=4)
        np.testing.assert_allclose(ta["w"], tb["w"], rtol=1e-6, atol=1e-6)
    assert sb.steps == 12


def test_delayed_nesterov_counts_every_contribution_of_a_merge() -> None:
    opt, state = OuterOptimizer(lr=1.0, momentum=0.5, delayed_every=4), OuterState()
    theta = {"w": np.zeros(1, np.float32)}
    theta, state = run(opt, state, theta, {"w": np.array([4.0], np.float32)})  # 1 of 4: theta -= 4/4
    np.testing.assert_allclose(theta["w"], [-1.0])
    theta, state = run(opt, state, theta, {"w": np.array([2.0], np.float32)}, count=2)  # 3 of 4: -= 2*2/4
    np.testing.assert_allclose(theta["w"], [-2.0])
    # steps 4 and 5 with the same gradient; step 4 is the boundary: B = 4 + 4 + 4 = 12, u = 12/4 = 3,
    # theta -= 0.5*3 + 4/4; step 5 starts the next buffer (B = 4): theta -= 4/4
    theta, state = run(opt, state, theta, {"w": np.array([4.0], np.float32)}, count=2)
    np.testing.assert_allclose(theta["w"], [-2.0 - 2.5 - 1.0])
    np.testing.assert_allclose(state.buffer["w"], [4.0])
    np.testing.assert_allclose(state.momentum["w"], [3.0])
    assert state.steps == 5
    with pytest.raises(ValueError, match="count"):
        opt.step(state, theta, {"w": np.zeros(1, np.float32)}, count=0)


@pytest.mark.parametrize("warmup", [0, 12])
@pytest.mark.parametrize("every", [1, 2, 3, 4])
def test_delayed_nesterov_a_merge_of_k_is_k_steps_of_algorithm_3(every: int, warmup: int) -> None:
    # Async Local-SGD's Algorithm 3 takes one outer gradient per step; a merged round of k
    # contributions must land exactly where k single steps with the merged gradient land, wherever
    # the boundaries fall inside the group (including groups that span several boundaries), and
    # during the outer warm-up with each step's own learning rate
    rng = np.random.default_rng(every)
    opt = OuterOptimizer(lr=0.7, momentum=0.9, delayed_every=every, warmup=warmup)
    grouped_state = single_state = OuterState()
    grouped = single = {"w": rng.standard_normal(5).astype(np.float32)}
    for count in (1, 3, 2, 5, 1, 4, 7):
        d = {"w": rng.standard_normal(5).astype(np.float32)}
        grouped, grouped_state = run(opt, grouped_state, grouped, d, count=count)
        for _ in range(count):
            single, single_state = run(opt, single_state, single, d)
        for got, want in (
            (grouped, single),
            (grouped_state.buffer, single_state.buffer),
            (grouped_state.momentum, single_state.momentum),
        ):
            assert set(got) == set(want)
            for name in got:
                np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)
        assert grouped_state.steps == single_state.steps


def test_delayed_segments_cut_a_merge_at_every_boundary() -> None:
    assert delayed_segments(3, 2, 4) == [(1, True), (1, False)]
    assert delayed_segments(0, 4, 4) == [(4, True)]
    assert delayed_segments(1, 9, 4) == [(3, True), (4, True), (2, False)]
    assert delayed_segments(5, 1, 4) == [(1, False)]
    with pytest.raises(ValueError, match="count"):
        delayed_segments(0, 0, 4)


def test_the_warm_up_raises_the_learning_rate_linearly_then_keeps_it() -> None:
    """``lr * (steps + 1) / warmup`` for the first ``warmup`` steps of the state, ``lr`` after; a
    step with the warm-up's rate is the plain step with that rate, momentum included."""
    opt = OuterOptimizer(lr=0.8, momentum=0.5, warmup=4)
    assert [float(opt.lr_at(s)) for s in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8, 0.8])
    assert OuterOptimizer(lr=0.8).lr_at(0) == np.float32(0.8)
    p = {"w": np.ones(3, np.float32)}
    d = {"w": np.array([0.1, -0.2, 0.3], np.float32)}
    state = OuterState()
    for s in range(6):
        got, new_state = opt.step(state, p, d)
        want, want_state = OuterOptimizer(lr=float(opt.lr_at(s)), momentum=0.5).step(state, p, d)
        np.testing.assert_array_equal(got["w"], want["w"])
        np.testing.assert_array_equal(new_state.momentum["w"], want_state.momentum["w"])
        state = new_state
    with pytest.raises(ValueError, match="warmup"):
        OuterOptimizer(warmup=-1)


def test_arrays_handed_over_are_kept_read_only_and_others_copied() -> None:
    rng = np.random.default_rng(5)
    state = OuterState(
        3,
        {"w": rng.standard_normal(4).astype(np.float32)},
        {},
        {"w": rng.standard_normal(4).astype(np.float32)},
    )
    arrays = codec.decode(
        codec.encode(state.to_arrays(), fragment=0, base_version=0, kind="params", quantizer="fp32")
    ).tensors
    copied = OuterState.from_arrays(arrays)
    given = OuterState.from_arrays(arrays, given=True)
    for name in ("momentum/w", "downlink/w"):
        assert arrays[name].flags.writeable is False  # handed over: made read-only, not copied
    assert np.shares_memory(given.momentum["w"], arrays["momentum/w"])
    assert not np.shares_memory(copied.momentum["w"], arrays["momentum/w"])
    for restored in (copied, given):
        assert restored.steps == 3
        np.testing.assert_array_equal(restored.momentum["w"], state.momentum["w"])
        np.testing.assert_array_equal(restored.residual["w"], state.residual["w"])
        assert not restored.momentum["w"].flags.writeable
