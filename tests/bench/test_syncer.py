"""The harness's synchronizer runs the shipped round pipeline on the service's own fragment state: it
reproduces the pinned round results that the synchronizer service reproduces (Delayed Nesterov and
staleness weighting included), screens as the service does, and takes a learner's progress in order."""

from __future__ import annotations

import numpy as np
from diloco_bench.syncer import Syncer, Upload
from diloco_core.learner import Sent
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
            # the schedule sends on bases older than a learner's merged progress, which the in-order rule
            # refuses: each round's contributions come from learners new to the fragment, in the cases' order
            for g in given:
                learner = 1000 * ord(g.learner_id) + version
                syncer.queue(
                    p,
                    Upload(learner, Sent(g.base_version, 0, g.steps, g.tokens, 1), g.tensors),
                    float(version),
                )
            merged = syncer.flush(p, float(version))  # every pending contribution, in learner order
            assert merged is not None
            pinned = golden[case.name][version]
            assert (merged.version, digest(merged.params), digest(syncer.outer[p].to_arrays())) == (
                pinned["version"], pinned["params"], pinned["outer"],
            ), f"{case.name} round {version}"  # fmt: skip
        assert syncer.outer[p] != OuterState()


def test_the_harness_screens_each_round_as_the_synchronizer_does() -> None:
    """A non-finite contribution is excluded and one far above the parameters' norm is merged
    clipped to its limit, each counted, and the honest ones merge: the benchmarks' rounds apply the
    shipped checks."""
    case = cases()[0]
    p = case.fragment.index
    others = {
        t.name: np.zeros(t.shape, np.float32) for f in PLAN.fragments if f.index != p for t in f.tensors
    }
    syncer = Syncer(case.settings, alive=4, plan=PLAN, params={**case.params, **others})
    honest = [
        Upload(i, Sent(0, 0, 8, 800, 1), {n: 0.01 * np.ones_like(v) for n, v in case.params.items()})
        for i in (0, 1)
    ]
    poisoned = Upload(2, Sent(0, 0, 8, 800, 1), {n: np.full_like(v, np.nan) for n, v in case.params.items()})
    huge = Upload(3, Sent(0, 0, 8, 800, 1), {n: 1e6 * np.ones_like(v) for n, v in case.params.items()})
    for c in (*honest, poisoned, huge):
        syncer.queue(p, c, 1.0)
    merged = syncer.flush(p, 1.0)
    assert merged is not None
    assert (syncer.excluded, syncer.clipped) == (1, 1)
    assert syncer.participants == 3
    assert all(np.isfinite(v).all() for v in merged.params.values())
    moved = max(float(np.abs(merged.params[n] - case.params[n]).max()) for n in case.params)
    assert 0 < moved < 1.0


def test_the_harness_takes_a_learners_progress_as_the_synchronizer_does() -> None:
    """A second send on the same base adds to the pending one (a continuation); a send overlapping the
    pending one, or on a base older than the learner's merged progress, is refused, as the service
    refuses it."""
    case = cases()[0]
    p = case.fragment.index
    others = {
        t.name: np.zeros(t.shape, np.float32) for f in PLAN.fragments if f.index != p for t in f.tensors
    }
    syncer = Syncer(case.settings, alive=4, plan=PLAN, params={**case.params, **others})
    step = {n: 0.01 * np.ones_like(v) for n, v in case.params.items()}
    syncer.queue(p, Upload(0, Sent(0, 0, 4, 400, 1), step), 1.0)
    syncer.queue(p, Upload(0, Sent(0, 4, 4, 400, 2), step), 2.0)  # the steps after step 4: added up
    assert syncer.queue(p, Upload(0, Sent(0, 6, 4, 400, 3), step), 2.5) == "overlaps_pending"  # 7, 8 again
    pending = syncer.fragments[p].pending["0"]
    assert (pending.since, pending.through, pending.tokens) == (0, 8, 800)
    assert np.allclose(next(iter(pending.tensors.values())), 0.02)
    assert syncer.flush(p, 3.0) is not None
    syncer.queue(p, Upload(0, Sent(1, 0, 4, 400, 1), step), 4.0)
    assert syncer.flush(p, 5.0) is not None
    assert syncer.queue(p, Upload(0, Sent(0, 8, 4, 400, 3), step), 6.0) == "already_merged"
    assert syncer.refused == 2
