"""Fixed sequences of rounds (inputs and settings) whose results are pinned in ``golden/rounds.json``.

The golden values were computed by the synchronizer's round path as it stood before the round's
mathematics moved into ``diloco_core.round_math``; every later implementation must reproduce them
bit for bit (float32 parameters and outer state, float64 weights). ``DILOCO_REGEN_GOLDEN=1``
rewrites the file from the current code.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from diloco_core.config import DiLoCoSettings
from diloco_core.fragments import Fragment, build_plan
from diloco_core.round_math import RoundResult

GOLDEN_ROUNDS = Path(__file__).parent / "golden" / "rounds.json"
SHAPES = [("wte.weight", (6, 4)), ("h.0.w", (5, 3)), ("h.0.b", (7,)), ("h.1.w", (4, 4))]


@dataclass(frozen=True)
class Given:
    """One contribution as a round receives it."""

    learner_id: str
    base_version: int
    steps: int
    tokens: int
    tensors: dict[str, npt.NDArray[np.float32]]


@dataclass(frozen=True)
class Case:
    name: str
    fragment: Fragment
    settings: DiLoCoSettings
    params: dict[str, npt.NDArray[np.float32]]
    rounds: tuple[tuple[Given, ...], ...]  # the contributions of each round, in merge order


# (learner, versions behind, steps, tokens) per contribution, per round
_SCHEDULE: tuple[tuple[tuple[str, int, int, int], ...], ...] = (
    (("a", 0, 8, 800),),
    (("a", 0, 8, 800), ("b", 1, 5, 640), ("c", 0, 8, 512)),
    (("b", 0, 3, 300), ("c", 2, 8, 800)),
    (("a", 1, 1, 0), ("b", 0, 2, 0)),  # no tokens at all: every weight is zero, the round falls back to 1
    (("a", 0, 8, 800), ("b", 0, 8, 800), ("c", 0, 8, 800), ("d", 3, 6, 900)),
    (("d", 0, 4, 100),),
    (("a", 0, 8, 700), ("c", 1, 7, 700)),
)


PLAN = build_plan(SHAPES, num_fragments=2, inner_steps=8, overlap=1, embedding_names=("wte.weight",))


def _fragments() -> tuple[Fragment, Fragment]:
    kinds = {f.kind: f for f in PLAN.fragments}
    return kinds["embedding"], kinds["dense"]


# the outer optimizer and codecs the pinned results were computed with, whatever the job's defaults
PINNED = {"outer_lr": 0.7, "outer_momentum": 0.9, "outer_warmup": 0, "codec": "int4", "down_codec": "fp32"}


def _case(name: str, fragment: Fragment, seed: int, **settings: object) -> Case:
    rng = np.random.default_rng(seed)
    params = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in fragment.tensors}
    rounds = []
    for version, schedule in enumerate(_SCHEDULE):
        given = []
        for learner, behind, steps, tokens in schedule:
            scale = np.float32(0.05 * (1 + ord(learner) % 4))
            tensors = {
                t.name: (scale * rng.standard_normal(t.shape)).astype(np.float32) for t in fragment.tensors
            }
            given.append(Given(learner, max(version - behind, 0), steps, tokens, tensors))
        rounds.append(tuple(given))
    return Case(name, fragment, DiLoCoSettings.model_validate(PINNED | settings), params, tuple(rounds))


def cases() -> list[Case]:
    embedding, dense = _fragments()
    return [
        _case("dense-rda-nesterov", dense, 1),
        _case("embedding-mean-nesterov", embedding, 2),
        _case("dense-delayed-3-staleness", dense, 3, delayed_nesterov=3, staleness_power=0.5),
        _case(
            "dense-mean-unweighted", dense, 4, merge_rule="mean", token_weighting=False, outer_momentum=0.5
        ),
        _case("embedding-delayed-2", embedding, 5, delayed_nesterov=2, outer_lr=1.0, staleness_power=1.0),
        _case("dense-rda-nesterov-down-int2", dense, 1, down_codec="int2"),
    ]


def digest(arrays: Mapping[str, npt.NDArray[np.floating]]) -> str:
    """sha256 of the tensors' names, dtypes, shapes and bytes (independent of any compressor)."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def summary(result: RoundResult) -> dict[str, object]:
    """What is pinned of one round: its version, weights and the digests of the new state."""
    return {
        "version": result.version,
        "weights": list(result.weights),
        "params": digest(result.params),
        "outer": digest(result.outer.to_arrays()),
    }


def load_golden() -> dict[str, list[dict[str, object]]]:
    golden: dict[str, list[dict[str, object]]] = json.loads(GOLDEN_ROUNDS.read_text())
    return golden


def write_golden(results: Mapping[str, list[dict[str, object]]]) -> None:
    GOLDEN_ROUNDS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
