"""The synthetic model and contributions of ``diloco bench sync-ingest`` (and of the benchmarks that
measure the synchronizer on the same ones): a plan of square tensors, a learner's int4 outer gradient
of a fragment, and its payload."""

from __future__ import annotations

import numpy as np
from diloco_core import codec
from diloco_core.fragments import FragmentPlan, build_plan
from diloco_core.quantize import DEFAULT_BLOCK_SIZE


def make_plan(params: int, fragments: int) -> FragmentPlan:
    side = max(8, int((params / (2 * fragments)) ** 0.5))
    shapes = [(f"h.{i}.w{j}", [side, side]) for i in range(fragments) for j in range(2)]
    return build_plan(shapes, fragments, inner_steps=max(fragments, 4), overlap=1)


def grad_parts(plan: FragmentPlan, p: int, seed: int) -> dict[str, codec.QuantizedTensor]:
    """A learner's int4 outer gradient of fragment ``p``, quantized once (made in float32, one tensor
    at a time, so that a fragment of a billion-parameter model costs its float32 size, not float64's)."""
    rng = np.random.default_rng(seed)
    parts = {}
    for t in plan.fragments[p].tensors:
        values = rng.standard_normal(t.shape, dtype=np.float32)
        values *= np.float32(0.01)
        parts.update(codec.quantized({t.name: values}, "int4", DEFAULT_BLOCK_SIZE))
        del values
    return parts


def framed(parts: dict[str, codec.QuantizedTensor], p: int, base_version: int = 0) -> bytes:
    """The contribution payload of ``parts`` on ``base_version``."""
    blob: bytes = codec.encode_quantized(
        parts, fragment=p, base_version=base_version, kind="outer_grad", quantizer="int4"
    )
    return blob
