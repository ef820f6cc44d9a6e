"""The synchronizer's round path reproduces the pinned round results bit for bit."""

from __future__ import annotations

import os

from diloco_sync.fragment_state import Contribution
from diloco_sync.merging import new_optimizer, run_round

from tests.core.round_cases import cases, digest, load_golden, write_golden


def _run_all() -> dict[str, list[dict[str, object]]]:
    results: dict[str, list[dict[str, object]]] = {}
    for case in cases():
        params, optimizer = dict(case.params), new_optimizer(case.settings)
        out: list[dict[str, object]] = []
        for version, given in enumerate(case.rounds):
            contributions = [
                Contribution(
                    learner_id=g.learner_id,
                    fragment=case.fragment.index,
                    base_version=g.base_version,
                    seq=0,
                    steps=g.steps,
                    tokens=g.tokens,
                    tensors=g.tensors,
                    nbytes=0,
                    received_at=0.0,
                )  # fmt: skip
                for g in given
            ]
            outcome = run_round(case.fragment, params, optimizer, version, contributions, case.settings)
            params = outcome.params
            out.append(
                {
                    "version": outcome.version,
                    "weights": list(outcome.weights),
                    "params": digest(outcome.params),
                    "outer": digest(optimizer.state_arrays()),
                }
            )
        results[case.name] = out
    return results


def test_the_round_path_reproduces_the_pinned_results() -> None:
    results = _run_all()
    if os.environ.get("DILOCO_REGEN_GOLDEN") == "1":
        write_golden(results)
    assert results == load_golden()
