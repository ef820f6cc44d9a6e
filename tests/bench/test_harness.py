"""The virtual-clock harness on a tiny model: determinism, accounting, and the reduction to DiLoCo."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diloco_bench import experiment, harness, runs, workload
from diloco_core.config import TrainSettings
from diloco_worker.model import build_gpt

pytestmark = pytest.mark.slow

TINY = workload.Workload(
    n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=2, corpus_bytes=200_000, eval_batches=1
)


@pytest.fixture(scope="module")
def corpus() -> workload.Corpus:
    return workload.Corpus(TINY)


def test_a_run_is_deterministic_in_its_seed(corpus: workload.Corpus) -> None:
    method, timing = runs.decoupled(3, inner_steps=4), runs.Timing(steps=8, noise=0.1)
    a, b = harness.run(method, TINY, timing, corpus, 1), harness.run(method, TINY, timing, corpus, 1)
    assert (a.eval_loss, a.bytes_up, a.virtual_time) == (b.eval_loss, b.bytes_up, b.virtual_time)
    c = harness.run(method, TINY, timing, corpus, 2)
    assert c.eval_loss != a.eval_loss
    assert (a.refused, c.refused) == (
        0,
        0,
    )  # the synchronizer's checks refuse nothing an honest learner sends


def test_synchronous_diloco_merges_everyone_every_h_steps(corpus: workload.Corpus) -> None:
    r = harness.run(runs.diloco_sync(3, inner_steps=4), TINY, runs.Timing(steps=12), corpus, 0)
    assert r.rounds == 3
    assert r.participants == 3
    assert r.goodput == pytest.approx(1.0)  # equal speeds: nobody waits at the barrier
    assert r.merged_share == pytest.approx(1.0)
    assert r.steps == [12, 12, 12]
    assert np.isfinite(r.eval_loss)


def test_lock_step_waits_for_the_slow_learner_and_decoupled_does_not(corpus: workload.Corpus) -> None:
    timing = runs.Timing(steps=8, speed_factors=(1.0, 1.5), time_budget=8.0)
    lock = harness.run(runs.decoupled(2, quorum=0, blocking=True, inner_steps=4), TINY, timing, corpus, 0)
    free = harness.run(runs.decoupled(2, inner_steps=4), TINY, timing, corpus, 0)
    assert lock.goodput < 0.95
    assert free.goodput == pytest.approx(1.0)
    assert sum(free.steps) > sum(lock.steps)


def test_bytes_follow_the_codec_and_data_parallel_sends_most(corpus: workload.Corpus) -> None:
    timing = runs.Timing(steps=8)
    dp = harness.run(runs.data_parallel(2), TINY, timing, corpus, 0)
    fp32 = harness.run(runs.decoupled(2, "fp32", inner_steps=4), TINY, timing, corpus, 0)
    int4 = harness.run(runs.decoupled(2, "int4", inner_steps=4), TINY, timing, corpus, 0)
    assert dp.bytes_per_token > fp32.bytes_per_token > int4.bytes_per_token > 0
    numel = sum(p.numel() for p in build_gpt(workload.model_settings(TINY, 0)).parameters())
    assert dp.bytes_up == [numel * 4 * 8] * 2
    assert max(int4.peak_up) < max(fp32.peak_up)


def test_rda_keeps_the_norm_and_the_mean_shrinks_it(corpus: workload.Corpus) -> None:
    timing = runs.Timing(steps=8)
    rda = harness.run(runs.decoupled(4, quorum=0, merge_rule="rda", inner_steps=4), TINY, timing, corpus, 0)
    mean = harness.run(runs.decoupled(4, quorum=0, merge_rule="mean", inner_steps=4), TINY, timing, corpus, 0)
    assert rda.norm_ratios
    assert mean.norm_ratios
    assert all(r == pytest.approx(1.0, abs=1e-3) for r in rda.norm_ratios)
    assert all(r < 1.0 for r in mean.norm_ratios)


def _reference_diloco(
    corpus: workload.Corpus, learners: int, inner: int, rounds: int, seed: int
) -> dict[str, np.ndarray]:
    """Synchronous DiLoCo written directly in torch: average outer gradient, SGD with Nesterov."""
    torch.manual_seed(seed)
    global_model = build_gpt(workload.model_settings(TINY, seed))
    outer = torch.optim.SGD(
        global_model.parameters(),
        lr=runs.BENCH_SETTINGS.outer_lr,
        momentum=runs.BENCH_SETTINGS.outer_momentum,
        nesterov=True,
    )
    cfg = TrainSettings(
        batch_size=TINY.batch_size, lr=TINY.lr, warmup_steps=TINY.warmup_steps, max_steps=inner * rounds
    )
    from diloco_worker.train import make_optimizer

    locals_ = [build_gpt(workload.model_settings(TINY, seed)) for _ in range(learners)]
    opts = [make_optimizer(m, cfg) for m in locals_]
    streams = [corpus.stream(TINY, m, learners, seed) for m in range(learners)]
    for r in range(rounds):
        deltas = []
        for model, opt, stream in zip(locals_, opts, streams, strict=True):
            model.load_state_dict(global_model.state_dict())
            for s in range(inner):
                workload.inner_step(model, opt, next(stream), r * inner + s, cfg)
            deltas.append(
                [
                    g.detach() - p.detach()
                    for g, p in zip(global_model.parameters(), model.parameters(), strict=True)
                ]
            )
        for i, p in enumerate(global_model.parameters()):
            p.grad = torch.stack([d[i] for d in deltas]).mean(0)
        outer.step()
    result: dict[str, np.ndarray] = workload.to_numpy(global_model)
    return result


def test_k_all_one_fragment_no_overlap_is_exactly_synchronous_diloco(corpus: workload.Corpus) -> None:
    method = runs.diloco_sync(2, inner_steps=3)
    sim = harness.DiLoCoRun(method, TINY, runs.Timing(steps=6), corpus, 0)
    torch.set_num_threads(1)
    sim.run()
    expected = _reference_diloco(corpus, 2, 3, 2, 0)
    assert sim.syncer.rounds == 2
    for name, value in expected.items():
        np.testing.assert_allclose(sim.syncer.global_params[name], value, rtol=1e-4, atol=1e-5)


def test_an_open_round_pulls_the_partial_progress_of_slower_learners(corpus: workload.Corpus) -> None:
    timing = runs.Timing(steps=32, speed_factors=(1.0, 1.0, 1.3, 1.3), time_budget=32.0)
    pulled = harness.run(runs.decoupled(4, inner_steps=8, partial=True), TINY, timing, corpus, 0)
    alone = harness.run(runs.decoupled(4, inner_steps=8, partial=False), TINY, timing, corpus, 0)
    assert pulled.partials > 0
    assert alone.partials == 0
    assert (pulled.refused, alone.refused) == (0, 0)  # partial progress is taken in order too
    # the slow half's steps reach the global model instead of being overwritten before they are sent
    assert pulled.merged_share > alone.merged_share
    assert pulled.participants > alone.participants
    no_grace = harness.run(
        runs.decoupled(4, inner_steps=8, partial=True, grace_gamma=0.0), TINY, timing, corpus, 0
    )
    assert no_grace.partials == 0  # a round without a grace window merges before anyone can answer


def test_the_device_flag_reaches_the_workload_and_cpu_stays_the_default() -> None:
    p = experiment.parser("x", None, steps=4)
    assert experiment.workload_from(p.parse_args([])).device == "cpu"
    assert experiment.workload_from(p.parse_args(["--device", "cuda"])).device == "cuda"


@pytest.mark.gpu
def test_every_method_runs_on_cuda_with_the_same_accounting() -> None:
    """Learners and the data-parallel model on the GPU (bf16 autocast): the bytes on the wire and the
    steps do not depend on the device; the losses are finite."""
    cuda = workload.Workload(**{**TINY.__dict__, "device": "cuda"})
    corpus = workload.Corpus(cuda)
    timing = runs.Timing(steps=8)
    for method in (
        runs.data_parallel(2),
        runs.diloco_sync(2, inner_steps=4),
        runs.decoupled(2, inner_steps=4),
    ):
        on_cpu = harness.run(method, TINY, timing, workload.Corpus(TINY), 0)
        on_gpu = harness.run(method, cuda, timing, corpus, 0)
        assert on_gpu.steps == on_cpu.steps
        assert np.isfinite(on_gpu.eval_loss)
        if method.kind == "dp":
            assert on_gpu.bytes_up == on_cpu.bytes_up


def test_compressed_downloads_leave_every_learner_with_the_synchronizers_versions(
    corpus: workload.Corpus,
) -> None:
    method = runs.decoupled(2, inner_steps=4, codec="int1", error_feedback=True, down_codec="int2")
    sim = harness.DiLoCoRun(method, TINY, runs.Timing(steps=12), corpus, 0)
    sim.run()
    for p, version in enumerate(sim.syncer.versions):
        assert version > 0
        for ln in sim.learners:
            known_version, known = ln.known[p]
            assert known_version == version
            for name, values in known.items():
                np.testing.assert_array_equal(values, sim.syncer.global_params[name])
    assert all(r is not None for ln in sim.learners for r in ln.residuals)


def test_low_bit_codecs_and_compressed_downloads_send_fewer_bytes(corpus: workload.Corpus) -> None:
    timing = runs.Timing(steps=8)
    int4 = harness.run(runs.decoupled(2, inner_steps=4), TINY, timing, corpus, 0)
    low = harness.run(runs.decoupled(2, inner_steps=4, codec="topk", error_feedback=True, down_codec="int1"),
                      TINY, timing, corpus, 0)  # fmt: skip
    assert sum(low.bytes_up) < sum(int4.bytes_up)
    assert low.bytes_down * 4 < int4.bytes_down
    assert np.isfinite(low.eval_loss)


def test_the_loss_is_evaluated_along_the_way(corpus: workload.Corpus) -> None:
    timing = runs.Timing(steps=8, eval_every=4)
    for method in (runs.data_parallel(2), runs.decoupled(2, inner_steps=4)):
        r = harness.run(method, TINY, timing, corpus, 0)
        assert [t for t, _ in r.curve] == [r.tokens // 2, r.tokens]
        assert r.curve[-1][1] == r.eval_loss
