"""The fragment plan: which tensors travel together, and when each fragment falls due.

Every learner computes the plan from the model's named shapes alone, so all learners and the
synchronizer agree by construction; ``FragmentPlan.hash()`` lets them check that they do.

Packing (docs/algorithm.md §3.1, §3.2): embedding tensors get their own fragment (merged with the
weighted mean); the other tensors are packed largest first into the currently smallest fragment,
ties broken by name ("balanced"), or by layer, layer ``i`` going to dense fragment ``i mod P``
("strided", Streaming DiLoCo §3). With P = 1 every tensor shares one "dense" fragment, because a
single fragment cannot keep the embeddings apart; the fragment lists them (``mean_tensors``) so
they are still merged with the weighted mean: the merge rule is chosen per tensor.

Schedule: fragment ``p`` has offset ``t_p = p * H // P``; a learner starts fragment ``p``'s step
counter at ``-t_p`` and sends the fragment when the counter reaches ``H`` (``is_due``), so the
fragments fall due at different steps (``diloco_core.learner.FragmentCounters.due``). The offsets are distinct only when P <= H, so a plan
with more fragments than inner steps is refused.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from math import prod
from typing import Any, Literal

FragmentKind = Literal["embedding", "dense"]
Strategy = Literal["balanced", "strided"]

PLAN_FORMAT = 1
_LAYER_RE = re.compile(r"(?:^|\.)(?:h|layers|layer|blocks|block)\.(\d+)\.")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class Fragment:
    index: int
    kind: FragmentKind
    tensors: tuple[TensorSpec, ...]
    offset: int
    mean_tensors: tuple[str, ...] = ()  # embeddings in a fragment shared with dense tensors (P = 1)

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)


@dataclass(frozen=True)
class FragmentPlan:
    fragments: tuple[Fragment, ...]
    inner_steps: int
    overlap: int
    strategy: str

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description; ``from_dict(to_dict())`` gives an equal plan."""
        return {
            "format": PLAN_FORMAT,
            "inner_steps": self.inner_steps,
            "overlap": self.overlap,
            "strategy": self.strategy,
            "fragments": [
                {
                    "index": f.index,
                    "kind": f.kind,
                    "offset": f.offset,
                    "tensors": [[t.name, list(t.shape)] for t in f.tensors],
                    **({"mean_tensors": list(f.mean_tensors)} if f.mean_tensors else {}),
                }
                for f in self.fragments
            ],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FragmentPlan:
        """Parse and validate a plan received from elsewhere; raises ``ValueError`` when malformed."""
        try:
            if d.get("format", PLAN_FORMAT) != PLAN_FORMAT:
                raise ValueError(f"unsupported plan format {d.get('format')!r}")
            frags = tuple(_fragment_from_dict(i, f) for i, f in enumerate(d["fragments"]))
            plan = cls(frags, _int(d["inner_steps"], 1), _int(d["overlap"], 0), str(d["strategy"]))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed fragment plan: {exc!r}") from exc
        names = [n for f in plan.fragments for n in f.names]
        if len(names) != len(set(names)):
            raise ValueError("malformed fragment plan: a tensor appears twice")
        if not plan.fragments:
            raise ValueError("malformed fragment plan: no fragments")
        if plan.strategy not in ("balanced", "strided") or plan.overlap >= plan.inner_steps:
            raise ValueError(f"malformed fragment plan: strategy {plan.strategy!r}, overlap {plan.overlap}")
        return plan

    def hash(self) -> str:
        """sha256 hex of the canonical JSON of names, shapes, kinds, assignment, H and τ."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @cached_property
    def _owner(self) -> dict[str, int]:
        return {name: f.index for f in self.fragments for name in f.names}

    def fragment_of(self, name: str) -> int:
        try:
            return self._owner[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the fragment plan") from None

    @property
    def num_params(self) -> int:
        return sum(f.numel for f in self.fragments)

    def is_due(self, index: int, steps_since_sync: int) -> bool:
        """True when fragment ``index`` has done its H inner steps since its last sync."""
        if not 0 <= index < len(self.fragments):
            raise IndexError(f"fragment {index} out of range (plan has {len(self.fragments)})")
        return steps_since_sync >= self.inner_steps


def _int(v: Any, minimum: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ValueError(f"malformed fragment plan: expected an integer >= {minimum}, got {v!r}")
    return v


def _fragment_from_dict(i: int, f: Mapping[str, Any]) -> Fragment:
    if _int(f["index"], 0) != i:
        raise ValueError(f"malformed fragment plan: fragment {i} has index {f['index']!r}")
    kind = f["kind"]
    if kind not in ("embedding", "dense"):
        raise ValueError(f"malformed fragment plan: unknown kind {kind!r}")
    tensors = []
    for name, shape in f["tensors"]:
        if not isinstance(name, str) or not name:
            raise ValueError(f"malformed fragment plan: bad tensor name {name!r}")
        tensors.append(TensorSpec(name, tuple(_int(s, 0) for s in shape)))
    mean = f.get("mean_tensors", [])
    names = {t.name for t in tensors}
    if not isinstance(mean, list) or any(not isinstance(n, str) or n not in names for n in mean):
        raise ValueError(f"malformed fragment plan: fragment {i}'s mean_tensors {mean!r} are not its tensors")
    return Fragment(i, kind, tuple(tensors), _int(f["offset"], 0), tuple(sorted(mean)))


def layer_index(name: str) -> int | None:
    """The transformer layer a tensor belongs to (``h.3.`` / ``layers.3.`` / ``blocks.3.``), if any."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def plan_differences(job: FragmentPlan, other: FragmentPlan) -> list[str]:
    """What makes ``other`` (a learner's plan) differ from the ``job``'s, each naming the setting
    and both values (empty when the plans are equal): the DiLoCo settings first, then the model."""
    out = []
    for what, setting, a, b in (
        (
            "inner steps H",
            "inner_steps (--inner-steps, spec.diloco.innerSteps)",
            job.inner_steps,
            other.inner_steps,
        ),
        (
            "fragments P",
            "fragments (--fragments, spec.diloco.fragments)",
            len(job.fragments),
            len(other.fragments),
        ),
        ("overlap", "overlap (--overlap, spec.diloco.overlap)", job.overlap, other.overlap),
        ("fragment strategy", "fragment_strategy (--fragment-strategy)", job.strategy, other.strategy),
    ):
        if a != b:
            out.append(f"{what}: the job's {a}, this learner's {b} ({setting})")
    ours = {t.name: t.shape for f in job.fragments for t in f.tensors}
    theirs = {t.name: t.shape for f in other.fragments for t in f.tensors}
    missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    reshaped = sorted(n for n in set(ours) & set(theirs) if ours[n] != theirs[n])
    if missing or extra or reshaped:
        parts = (
            ([f"lacks {missing[:3]}"] if missing else [])
            + ([f"adds {extra[:3]}"] if extra else [])
            + [f"{n} is {tuple(theirs[n])}, the job's {tuple(ours[n])}" for n in reshaped[:3]]
        )
        out.append(f"model: this learner's {'; '.join(parts)} (the model settings or entry point differ)")
    if not out and job.hash() != other.hash():
        out.append(
            "fragment assignment: the same tensors are grouped differently (the embedding names differ)"
        )
    return out


def build_plan(
    named_shapes: Sequence[tuple[str, Sequence[int]]],
    num_fragments: int,
    inner_steps: int,
    overlap: int = 1,
    strategy: Strategy = "balanced",
    embedding_names: Collection[str] = (),
) -> FragmentPlan:
    """Split the tensors into ``num_fragments`` fragments; deterministic in the input's content, not order."""
    specs = _validate(named_shapes, num_fragments, inner_steps, overlap, strategy, embedding_names)
    embeddings = [s for s in specs if s.name in embedding_names]
    dense = [s for s in specs if s.name not in embedding_names]
    has_emb_fragment = bool(embeddings) and bool(dense) and num_fragments > 1
    groups: list[list[TensorSpec]]
    if not has_emb_fragment:
        groups = _pack(specs, num_fragments, strategy)
        only: FragmentKind = "embedding" if not dense else "dense"
        kinds: list[FragmentKind] = [only] * num_fragments
    else:
        groups = [embeddings, *_pack(dense, num_fragments - 1, strategy)]
        dense_kind: list[FragmentKind] = ["dense"] * (num_fragments - 1)
        kinds = ["embedding", *dense_kind]
    for i, g in enumerate(groups):
        if not g:
            raise ValueError(
                f"cannot split {len(specs)} tensors into {num_fragments} fragments: fragment {i} would be "
                "empty; use fewer fragments"
            )
    frags = tuple(
        Fragment(
            i,
            kinds[i],
            tuple(sorted(g, key=lambda s: s.name)),
            i * inner_steps // num_fragments,
            tuple(sorted(s.name for s in g if s.name in embedding_names)) if kinds[i] == "dense" else (),
        )
        for i, g in enumerate(groups)
    )
    return FragmentPlan(frags, inner_steps, overlap, strategy)


def _validate(
    named_shapes: Sequence[tuple[str, Sequence[int]]],
    num_fragments: int,
    inner_steps: int,
    overlap: int,
    strategy: str,
    embedding_names: Collection[str],
) -> list[TensorSpec]:
    if num_fragments < 1:
        raise ValueError(f"num_fragments must be >= 1, got {num_fragments}")
    if num_fragments > inner_steps:
        raise ValueError(
            f"{num_fragments} fragments need at least as many inner steps (got {inner_steps}): "
            "with fewer, fragments would fall due at the same step"
        )
    if inner_steps < 1:
        raise ValueError(f"inner_steps must be >= 1, got {inner_steps}")
    if not 0 <= overlap < inner_steps:
        raise ValueError(f"overlap must be in [0, inner_steps), got {overlap} with inner_steps {inner_steps}")
    if strategy not in ("balanced", "strided"):
        raise ValueError(f"unknown fragment strategy {strategy!r} (expected 'balanced' or 'strided')")
    specs = sorted(
        (TensorSpec(str(n), tuple(int(d) for d in s)) for n, s in named_shapes), key=lambda s: s.name
    )
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in the model")
    if any(d < 0 for s in specs for d in s.shape):
        raise ValueError("negative dimension in a tensor shape")
    unknown = set(embedding_names) - set(names)
    if unknown:
        raise ValueError(f"embedding names not in the model: {sorted(unknown)}")
    return specs


def _pack(specs: Sequence[TensorSpec], n: int, strategy: str) -> list[list[TensorSpec]]:
    groups: list[list[TensorSpec]] = [[] for _ in range(n)]
    sizes = [0] * n
    rest = list(specs)
    if strategy == "strided":
        rest = []
        for s in specs:
            layer = layer_index(s.name)
            if layer is None:
                rest.append(s)
            else:
                groups[layer % n].append(s)
                sizes[layer % n] += s.numel
    for s in sorted(rest, key=lambda s: (-s.numel, s.name)):
        target = min(range(n), key=lambda i: (sizes[i], i))
        groups[target].append(s)
        sizes[target] += s.numel
    return groups
