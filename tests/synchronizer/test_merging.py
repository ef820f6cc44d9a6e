"""The synchronizer's round path (the pinned round results bit for bit, the blobs it commits) and the
round logs read back at start-up."""

from __future__ import annotations

import zstandard
from diloco_core import codec
from diloco_core.outer import OuterState
from diloco_core.uploads import MemoryUpload
from diloco_sync.contribution import Contribution
from diloco_sync.merging import recent_round_keys, rounds_from_logs, run_round, write_outer_state

from tests.core.round_cases import cases, digest, load_golden, summary


def _run_all() -> dict[str, list[dict[str, object]]]:
    results: dict[str, list[dict[str, object]]] = {}
    for case in cases():
        params, outer = dict(case.params), OuterState()
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
            outcome = run_round(case.fragment, params, outer, version, contributions, case.settings)
            params, outer = outcome.result.params, outcome.result.outer
            # what is committed decodes to exactly what was computed
            served = codec.decode(outcome.payload, fragment=case.fragment)
            assert (served.base_version, digest(served.tensors)) == (version + 1, digest(params))
            stored = MemoryUpload(lambda data: None)
            write_outer_state(stored, outer, case.fragment.index, version + 1)
            assert digest(codec.decode(bytes(stored.data)).tensors) == digest(outer.to_arrays())
            frame = zstandard.get_frame_parameters(bytes(stored.data[codec._PREFIX.size :]))
            assert frame.window_size == 1 << 17  # stored as it is (stored_frame), not compressed
            out.append(summary(outcome.result))
        results[case.name] = out
    return results


def test_the_round_path_reproduces_the_pinned_results() -> None:
    assert _run_all() == load_golden()


def test_recent_rounds_come_back_from_the_round_logs_newest_last() -> None:
    assert recent_round_keys({0: 3, 1: 1}, 2) == [(0, 3), (0, 2), (1, 1)]
    assert recent_round_keys({0: 0}, 5) == []

    def entry(p: int, v: int, at: float) -> dict[str, object]:
        return {
            "fragment": p,
            "version": v,
            "participants": ["a"],
            "weights": [1.0],
            "base_versions": [v - 1],
            "finished_at": at,
            "quorum_wait_s": 0.1,
            "grace_s": 0.0,
            "merge_s": 0.01,
            "keys": ["k"],
        }

    newer = entry(0, 3, 30.0) | {
        "steps": [4],
        "tokens": [32],
        "excluded": [{"learner": "b", "key": "b/0/2/1", "reason": "x"}],
        "clipped": [{"learner": "c", "key": "c/0/2/1", "reason": "above the limit"}],
        "update_clipped": "taken at the limit",
    }
    logs = [newer, entry(0, 2, 10.0), entry(1, 2, 20.0), {"fragment": 1}]  # the last: unreadable
    rounds = rounds_from_logs(logs, 2)
    assert [(r.fragment, r.version) for r in rounds] == [(1, 2), (0, 3)]
    assert (rounds[0].steps, rounds[1].steps, rounds[1].excluded[0].learner) == (
        [],
        [4],
        "b",
    )  # older logs: defaults
    assert (rounds[1].clipped[0].learner, rounds[1].update_clipped) == ("c", "taken at the limit")
    assert (rounds[0].clipped, rounds[0].update_clipped) == ([], None)
