from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from diloco_core import feedback
from diloco_core.fragments import build_plan
from diloco_core.learner import outer_gradient
from diloco_core.storage import FilesystemStore
from diloco_worker.anchors import HostAnchors
from diloco_worker.checkpoint import load_latest, restore, save_checkpoint
from diloco_worker.fragment_state import FragmentState
from diloco_worker.model import EMBEDDING_NAMES, build_gpt
from diloco_worker.train import make_optimizer

from tests.worker.helpers import TINY, tiny_train


def _state(h: int = 4, p: int = 2) -> tuple[FragmentState, torch.nn.Module]:
    model = build_gpt(TINY)
    named = [(n, tuple(t.shape)) for n, t in model.named_parameters()]
    plan = build_plan(named, p, h, 1, embedding_names=EMBEDDING_NAMES)
    return FragmentState.for_model(plan, model), model


def test_fragments_fall_due_at_staggered_steps_and_again_after_h_more() -> None:
    fs, _ = _state(h=4, p=2)  # offsets 0 and 2
    due_at: dict[int, list[int]] = {0: [], 1: []}
    for step in range(1, 13):
        fs.advance(10)
        for p in fs.due():
            due_at[p].append(step)
            fs.mark_sent(p)  # no global comes back: due again H steps later
    assert due_at == {0: [4, 8, 12], 1: [6, 10]}


def test_tokens_count_only_once_the_counter_is_positive() -> None:
    fs, _ = _state(h=4, p=2)
    for _ in range(3):
        fs.advance(10)
    assert [c.tokens for c in fs.counters] == [30, 10]


def test_outer_gradient_is_anchor_minus_params() -> None:
    fs, model = _state()
    with torch.no_grad():
        model.wte.weight.add_(0.25)
    for _ in range(4):
        fs.advance(5)
    c = fs.take_contribution(0)
    assert c.steps == 4
    assert c.tokens == 20
    assert c.seq == 1
    assert np.allclose(c.tensors["wte.weight"], -0.25)
    assert np.allclose(c.tensors["wpe.weight"], 0.0)


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_applying_a_global_mixes_resets_counters_and_moves_the_anchor(alpha: float) -> None:
    fs, model = _state()
    for _ in range(5):
        fs.advance(5)
    before = model.wte.weight.detach().clone()
    glob = {
        n: np.full(s.shape, 1.0, dtype=np.float32) for s in fs.plan.fragments[0].tensors for n in [s.name]
    }
    fs.apply(0, 7, glob, alpha)
    expected = alpha * before + (1 - alpha) * 1.0
    assert torch.allclose(model.wte.weight, expected)
    assert fs.counters[0].base_version == 7
    assert (fs.counters[0].steps, fs.counters[0].tokens) == (0, 0)
    assert fs.counters[1].steps == 5 - fs.plan.fragments[1].offset  # other fragments untouched
    assert np.array_equal(fs.anchors[0]["wte.weight"], glob["wte.weight"])


def test_first_contact_keeps_the_staggered_counters() -> None:
    fs, model = _state(h=4, p=2)
    glob = {n: np.zeros(s.shape, dtype=np.float32) for s in fs.plan.fragments[1].tensors for n in [s.name]}
    fs.set_base(1, 3, glob)
    assert fs.counters[1].steps == -fs.plan.fragments[1].offset
    assert fs.counters[1].base_version == 3
    name = fs.plan.fragments[1].names[0]
    assert float(dict(model.named_parameters())[name].detach().abs().sum()) == 0.0


def test_checkpoint_meta_round_trip() -> None:
    fs, _ = _state()
    for _ in range(6):
        fs.advance(3)
    fs.take_contribution(0)
    other, _ = _state()
    other.load_meta(fs.meta(), fs.anchors)
    assert other.meta() == fs.meta()
    with pytest.raises(ValueError, match="checkpoint has 1 fragments"):
        other.load_meta(fs.meta()[:1], {})


def _contribution_blob(fs: FragmentState, model: torch.nn.Module, p: int, shift: float) -> bytes:
    g = torch.Generator().manual_seed(int(shift * 1000))  # the same training for every copy
    with torch.no_grad():
        for t in model.parameters():
            t.add_(shift * torch.randn(t.shape, generator=g))
    for _ in range(4):
        fs.advance(5)
    return fs.take_contribution(p, "int1", error_feedback=True).tensors.encode(
        fragment=p, base_version=fs.counters[p].base_version, quantizer="int1"
    )


def test_error_feedback_resumes_from_a_checkpoint_with_its_residuals(tmp_path: Path) -> None:
    fs, model = _state()
    for p in range(len(fs.plan.fragments)):
        fs.set_base(p, 0, fs.anchors[p])
    opt = make_optimizer(model, tiny_train())
    _contribution_blob(fs, model, 0, 0.013)
    assert any(np.abs(r).max() > 0 for r in fs.residuals[0].values())
    store = FilesystemStore(tmp_path)
    save_checkpoint(
        store, model=model, optimizer=opt, anchors=fs.anchors, meta={"step": 4}, residuals=fs.residuals
    )

    resumed, other_model = _state()
    ckpt = load_latest(store)
    assert ckpt is not None
    restore(ckpt, other_model, make_optimizer(other_model, tiny_train()))
    resumed.load_meta(fs.meta(), ckpt.anchors(), ckpt.residuals())
    forgetful, third_model = _state()
    restore(ckpt, third_model, make_optimizer(third_model, tiny_train()))
    forgetful.load_meta(fs.meta(), ckpt.anchors())  # the residual lost

    expected = _contribution_blob(fs, model, 0, 0.007)
    assert _contribution_blob(resumed, other_model, 0, 0.007) == expected
    assert _contribution_blob(forgetful, third_model, 0, 0.007) != expected
    for name, r in fs.residuals[0].items():
        np.testing.assert_array_equal(resumed.residuals[0][name], r)


def test_without_error_feedback_no_residual_is_kept() -> None:
    fs, model = _state()
    for p in range(len(fs.plan.fragments)):
        fs.set_base(p, 0, fs.anchors[p])
    for _ in range(4):
        fs.advance(5)
    fs.take_contribution(0, "int1")
    assert fs.residuals == {}


class _ThreadRecordingAnchors(HostAnchors):
    """The numpy store, noting which thread writes each residual."""

    def __init__(self, plan, params) -> None:  # type: ignore[no-untyped-def]
        super().__init__(plan, params)
        self.writers: list[str] = []

    def set_residual(self, p: int, arrays) -> None:  # type: ignore[no-untyped-def]
        self.writers.append(threading.current_thread().name)
        super().set_residual(p, arrays)


def test_numpy_error_feedback_is_encoded_off_the_training_thread_in_the_order_fragments_fell_due() -> None:
    model = build_gpt(TINY)
    plan = build_plan([(n, tuple(t.shape)) for n, t in model.named_parameters()], 2, 4, 1,
                      embedding_names=EMBEDDING_NAMES)  # fmt: skip
    fs = FragmentState.for_model(plan, model, _ThreadRecordingAnchors)
    anchors0 = {p: {n: a.copy() for n, a in fs.store.arrays(p).items()} for p in range(2)}
    residual: dict[int, dict[str, np.ndarray] | None] = {0: None, 1: None}
    for rnd in range(3):
        with torch.no_grad():
            for t in model.parameters():
                t.add_(0.01 * torch.randn(t.shape, generator=torch.Generator().manual_seed(rnd)))
        for p in range(2):
            params = {n: model.get_parameter(n).detach().numpy().copy() for n in plan.fragments[p].names}
            got = fs.take_contribution(p, "int2", error_feedback=True)
            # the reference: the same chain computed synchronously
            expected = feedback.encode(outer_gradient(anchors0[p], params), residual[p], fragment=p,
                                       base_version=got.base_version, kind="outer_grad", quantizer="int2")  # fmt: skip
            residual[p], anchors0[p] = expected.residual, params
            assert got.encode("int2") == expected.blob, (rnd, p)
    assert fs.store.writers  # type: ignore[attr-defined]
    assert all(name.startswith("feedback-") for name in fs.store.writers)  # type: ignore[attr-defined]
    for p in range(2):
        for name, r in fs.residuals[p].items():
            np.testing.assert_array_equal(r, residual[p][name])  # type: ignore[index]
