"""The torch anchor store (the learner's device path) against the numpy reference, run on the CPU:
the same payload bytes, the same parameters and anchors after taking a global version, the same
checkpointed anchors; and where the anchors are placed on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diloco_core.codec import decode
from diloco_core.fragments import build_plan
from diloco_worker.anchors import HostAnchors, build_anchor_store
from diloco_worker.device_anchors import DeviceAnchors, StagedGlobal, choose_placement
from diloco_worker.fragment_state import FragmentState
from diloco_worker.model import EMBEDDING_NAMES, build_gpt

from tests.worker.helpers import TINY

QUANTIZERS = ["fp32", "bf16", "fp16", "int8", "int4", "e3m0", "int2"]


def _pair(p: int = 3) -> tuple[tuple[FragmentState, torch.nn.Module], tuple[FragmentState, torch.nn.Module]]:
    """Two identical models, one with the numpy store and one with the torch store on the CPU."""
    out = []
    for store in (HostAnchors, lambda plan, params: DeviceAnchors(plan, params, torch.device("cpu"))):
        model = build_gpt(TINY)
        named = [(n, tuple(t.shape)) for n, t in model.named_parameters()]
        plan = build_plan(named, p, 4, 1, embedding_names=EMBEDDING_NAMES)
        out.append((FragmentState.for_model(plan, model, store), model))
    return out[0], out[1]


def _train_a_little(models: list[torch.nn.Module], seed: int) -> None:
    """The same pseudo-update of every model (in place, as an optimizer step would)."""
    for model in models:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.01)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_the_torch_store_sends_the_reference_payloads_and_takes_globals_identically(quantizer: str) -> None:
    (ref, ref_model), (dev, dev_model) = _pair()
    assert isinstance(dev.store, DeviceAnchors)
    for rnd in range(3):
        _train_a_little([ref_model, dev_model], seed=rnd)
        sent = {}
        for p in range(len(ref.plan.fragments)):
            sent[p] = ref.take_contribution(p, quantizer).encode(quantizer)
            assert dev.take_contribution(p, quantizer).encode(quantizer) == sent[p], (rnd, p)
        # a global version arrives for fragment rnd % P: both take it, mixed or not
        p = rnd % len(ref.plan.fragments)
        glob = {n: v + np.float32(0.125) for n, v in decode(sent[p]).tensors.items()}
        alpha = 0.3 if rnd == 1 else 0.0
        ref.apply(p, rnd, glob, alpha)
        dev.apply(p, rnd, dev.store.stage(p, glob), alpha)
        for name, t in _params(ref_model).items():
            assert torch.equal(t, _params(dev_model)[name]), (rnd, name)
        for q, arrays in ref.anchors.items():
            for name, x in arrays.items():
                assert np.array_equal(x, dev.anchors[q][name]), (rnd, q, name)


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_with_error_feedback_the_torch_store_sends_the_reference_payloads_and_keeps_its_residuals(
    quantizer: str,
) -> None:
    """The residual lives in the torch store, updated with the quantization (off the training
    thread on a GPU); payloads, residuals and a resumed learner's next payloads are the reference's."""
    (ref, ref_model), (dev, dev_model) = _pair()
    assert dev.store.feeds_back(quantizer)
    assert not ref.store.feeds_back(quantizer)
    for rnd in range(3):
        _train_a_little([ref_model, dev_model], seed=rnd)
        for p in range(len(ref.plan.fragments)):
            expected = ref.take_contribution(p, quantizer, error_feedback=True).encode(quantizer)
            assert dev.take_contribution(p, quantizer, error_feedback=True).encode(quantizer) == expected, (
                rnd,
                p,
            )
        assert ref.residuals.keys() == dev.residuals.keys() == set(range(len(ref.plan.fragments)))
        for p, arrays in ref.residuals.items():
            for name, r in arrays.items():
                assert np.array_equal(r.view(np.uint32), dev.residuals[p][name].view(np.uint32)), (
                    rnd,
                    p,
                    name,
                )
    if quantizer != "fp32":  # fp32 leaves nothing out
        assert any(np.abs(r).max() > 0 for arrays in ref.residuals.values() for r in arrays.values())
    # a learner resumed from the checkpointed anchors and residuals sends what the original sends
    (_, _), (resumed, resumed_model) = _pair()
    resumed_model.load_state_dict(dev_model.state_dict())
    resumed.load_meta(dev.meta(), dev.anchors, dev.residuals)
    _train_a_little([dev_model, resumed_model], seed=9)
    for p in range(len(dev.plan.fragments)):
        a = dev.take_contribution(p, quantizer, error_feedback=True).encode(quantizer)
        assert resumed.take_contribution(p, quantizer, error_feedback=True).encode(quantizer) == a, p


def test_formats_without_a_torch_quantizer_keep_error_feedback_in_numpy_on_the_device_path() -> None:
    (ref, ref_model), (dev, dev_model) = _pair(p=2)
    assert not dev.store.feeds_back("int1")
    for rnd in range(2):
        _train_a_little([ref_model, dev_model], seed=rnd)
        for p in range(2):
            expected = ref.take_contribution(p, "int1", error_feedback=True).encode("int1")
            assert dev.take_contribution(p, "int1", error_feedback=True).encode("int1") == expected
    for p, arrays in ref.residuals.items():
        for name, r in arrays.items():
            assert np.array_equal(r, dev.residuals[p][name])


def test_a_staged_global_reads_as_its_arrays_and_a_plain_one_is_staged_on_apply() -> None:
    (ref, ref_model), (dev, dev_model) = _pair(p=2)
    glob = {s.name: np.full(s.shape, 0.5, np.float32) for s in ref.plan.fragments[1].tensors}
    staged = dev.store.stage(1, glob)
    assert isinstance(staged, StagedGlobal)
    assert dict(staged) == glob
    dev.apply(1, 4, glob, 0.0)  # a plain mapping (what a unit's other ranks receive)
    ref.set_base(1, 4, glob)
    assert all(torch.equal(t, _params(dev_model)[n]) for n, t in _params(ref_model).items())
    assert dev.counters[1].base_version == 4


def test_checkpointed_anchors_round_trip_through_the_torch_store() -> None:
    (ref, ref_model), (dev, dev_model) = _pair(p=2)
    _train_a_little([ref_model, dev_model], seed=7)
    saved = ref.anchors
    for p, arrays in saved.items():
        shifted = {n: v - np.float32(1.5) for n, v in arrays.items()}
        ref.load_meta(ref.meta(), {p: shifted})
        dev.load_meta(dev.meta(), {p: shifted})
    assert ref.take_contribution(0, "int8").encode("int8") == dev.take_contribution(0, "int8").encode("int8")
    for p in saved:
        assert all(np.array_equal(dev.anchors[p][n], ref.anchors[p][n]) for n in saved[p])


def test_a_snapshot_is_the_state_at_its_step_not_later() -> None:
    """The outer gradient is taken at the boundary: later training does not change its payload."""
    (ref, ref_model), (dev, dev_model) = _pair(p=1)
    _train_a_little([ref_model, dev_model], seed=1)
    a, b = ref.take_contribution(0, "fp32"), dev.take_contribution(0, "fp32")
    _train_a_little([ref_model, dev_model], seed=2)
    assert a.encode("fp32") == b.encode("fp32")
    with pytest.raises(ValueError, match="quantized as fp32, asked for int4"):
        b.encode("int4")


def test_auto_picks_the_numpy_reference_on_a_cpu_and_torch_when_asked() -> None:
    model = build_gpt(TINY)
    plan = build_plan([(n, tuple(t.shape)) for n, t in model.named_parameters()], 2, 4, 1)
    params = dict(model.named_parameters())
    assert isinstance(build_anchor_store(plan, params, torch.device("cpu")), HostAnchors)
    assert isinstance(build_anchor_store(plan, params, torch.device("cpu"), compute="torch"), DeviceAnchors)


GiB = 1 << 30


@pytest.mark.parametrize(
    ("anchor", "params", "free", "total", "where"),
    [
        (1 * GiB, 1 * GiB, 60 * GiB, 80 * GiB, "device"),  # a small model on an idle H100
        (20 * GiB, 20 * GiB, 78 * GiB, 80 * GiB, "device"),  # 20 + 40 + 16 (reserve) = 76 <= 78
        (20 * GiB, 20 * GiB, 70 * GiB, 80 * GiB, "host"),  # the same with less free memory
        (30 * GiB, 30 * GiB, 79 * GiB, 80 * GiB, "host"),  # the moments alone fill the device
    ],
)
def test_anchors_go_to_pinned_host_memory_when_they_do_not_fit(
    anchor: int, params: int, free: int, total: int, where: str
) -> None:
    got = choose_placement(
        anchor_bytes=anchor, param_bytes=params, work_bytes=0, free_bytes=free, total_bytes=total
    )
    assert got == where


@pytest.mark.gpu
@pytest.mark.parametrize("feedback", [False, True])
@pytest.mark.parametrize("memory", ["device", "host"])
@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_on_cuda_the_side_stream_path_sends_the_reference_payloads(
    memory: str, quantizer: str, feedback: bool
) -> None:
    """Anchors (and error-feedback residuals) on the GPU or in pinned host memory, side and staging
    streams, pinned results."""
    ref_model = build_gpt(TINY)
    cuda_model = build_gpt(TINY).cuda()
    plan = build_plan([(n, tuple(t.shape)) for n, t in ref_model.named_parameters()], 3, 4, 1,
                      embedding_names=EMBEDDING_NAMES)  # fmt: skip
    ref = FragmentState.for_model(plan, ref_model)
    dev = FragmentState.for_model(
        plan,
        cuda_model,
        lambda plan, params: DeviceAnchors(plan, params, torch.device("cuda"), memory),  # type: ignore[arg-type]
    )
    assert isinstance(dev.store, DeviceAnchors)
    assert dev.store.placement == memory
    for rnd in range(3):
        with torch.no_grad():
            for m in (ref_model, cuda_model):
                g = torch.Generator().manual_seed(rnd)
                for p in m.parameters():
                    p.add_((torch.randn(p.shape, generator=g) * 0.01).to(p.device))
        contributions = [(ref.take_contribution(p, quantizer, feedback), dev.take_contribution(p, quantizer, feedback))
                         for p in range(3)]  # fmt: skip
        with torch.no_grad():  # training goes on before the sender encodes
            for p in cuda_model.parameters():
                p.mul_(2.0)
            for p in ref_model.parameters():
                p.mul_(2.0)
        for a, b in contributions:
            assert a.encode(quantizer) == b.encode(quantizer)
        glob = {s.name: np.full(s.shape, 0.25 * rnd, np.float32) for s in plan.fragments[rnd].tensors}
        ref.apply(rnd, rnd, glob, 0.0)
        dev.apply(rnd, rnd, dev.store.stage(rnd, glob), 0.0)
        for (name, a_t), b_t in zip(ref_model.named_parameters(), cuda_model.parameters(), strict=True):
            assert torch.equal(a_t.detach(), b_t.detach().cpu()), name
        for p, arrays in ref.residuals.items():
            for name, r in arrays.items():
                assert np.array_equal(r.view(np.uint32), dev.residuals[p][name].view(np.uint32)), (
                    rnd,
                    p,
                    name,
                )
