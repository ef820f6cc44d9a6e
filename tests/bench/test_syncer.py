"""The harness's synchronizer runs the shipped round pipeline: it reproduces the pinned round results
that the synchronizer service reproduces (Delayed Nesterov and staleness weighting included)."""

from __future__ import annotations

import numpy as np
from diloco_bench.syncer import Pending, Syncer
from diloco_core.outer import OuterState

from tests.core.round_cases import PLAN, cases, digest, load_golden


def test_the_harness_merges_reproduce_the_pinned_round_results() -> None:
    golden = load_golden()
    for case in cases():
        p = case.fragment.index
        others = {
            t.name: np.zeros(t.shape, np.float32) for f in PLAN.fragments if f.index != p for t in f.tensors
        }
        syncer = Syncer(case.settings, alive=4, plan=PLAN, params={**case.params, **others})
        for version, given in enumerate(case.rounds):
            assert syncer.versions[p] == version
            syncer.pending[p] = {
                ord(g.learner_id): Pending(ord(g.learner_id), g.base_version, g.steps, g.tokens, g.tensors)
                for g in given
            }
            merged = syncer.flush(p)  # every pending contribution, in learner order (the cases' order)
            assert merged is not None
            pinned = golden[case.name][version]
            assert (merged.version, digest(merged.params), digest(syncer.outer[p].to_arrays())) == (
                pinned["version"], pinned["params"], pinned["outer"],
            ), f"{case.name} round {version}"  # fmt: skip
        assert syncer.outer[p] != OuterState()


def test_the_harness_screens_each_round_as_the_synchronizer_does() -> None:
    """A non-finite contribution and one far above the parameters' norm are excluded, each with its
    reason counted, and the honest ones merge: the benchmarks' rounds apply the shipped checks."""
    case = cases()[0]
    p = case.fragment.index
    others = {
        t.name: np.zeros(t.shape, np.float32) for f in PLAN.fragments if f.index != p for t in f.tensors
    }
    syncer = Syncer(case.settings, alive=4, plan=PLAN, params={**case.params, **others})
    honest = [
        Pending(i, 0, 8, 800, {n: 0.01 * np.ones_like(v) for n, v in case.params.items()}) for i in (0, 1)
    ]
    poisoned = Pending(2, 0, 8, 800, {n: np.full_like(v, np.nan) for n, v in case.params.items()})
    huge = Pending(3, 0, 8, 800, {n: 1e6 * np.ones_like(v) for n, v in case.params.items()})
    syncer.pending[p] = {c.learner: c for c in (*honest, poisoned, huge)}
    merged = syncer.flush(p)
    assert merged is not None
    assert syncer.excluded == 2
    assert syncer.participants == 2
    assert all(np.isfinite(v).all() for v in merged.params.values())
    moved = max(float(np.abs(merged.params[n] - case.params[n]).max()) for n in case.params)
    assert 0 < moved < 1.0
