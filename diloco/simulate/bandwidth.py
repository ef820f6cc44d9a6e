"""WAN bandwidth each method needs, from the model size and the step time (a closed-form link model).

* Data-parallel sends the full gradient every step: ``params * bytes_per_value`` per step, and it
  must be exchanged within the step to keep the chips busy, so mean = peak.
* DiLoCo (one fragment, P = 1) sends the whole model's outer gradient, quantized to ``bits`` per
  value, once per H steps; it has to leave within the overlap window of tau steps.
* Decoupled / Streaming DiLoCo with P fragments sends one fragment (params / P values) every H / P
  steps: the same mean as DiLoCo, a P times lower peak.

Figures are per learner (per site), one direction, in Gbit/s, payload only (no codec overhead,
no protocol headers). All-reduce algorithms send up to twice the payload; that factor is left out
for every method alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkSettings:
    params: float = 12e9
    step_time_s: float = 1.0
    bytes_per_value: float = 2.0
    inner_steps: int = 100
    fragments: int = 4
    overlap: int = 1
    quantizer_bits: float = 4.0

    def __post_init__(self) -> None:
        checks = {
            "params": self.params > 0,
            "step_time_s": self.step_time_s > 0,
            "bytes_per_value": self.bytes_per_value > 0,
            "inner_steps": self.inner_steps >= 1,
            "fragments": 1 <= self.fragments <= self.inner_steps,
            "overlap": 1 <= self.overlap <= max(1, self.inner_steps // self.fragments),
            "quantizer_bits": self.quantizer_bits > 0,
        }
        for name, ok in checks.items():
            value = getattr(self, name)
            if not ok or (isinstance(value, float) and not math.isfinite(value)):
                raise ValueError(
                    f"invalid {name}={value!r}: need params, step time, bytes and bits > 0, "
                    f"1 <= fragments <= inner_steps, 1 <= overlap <= inner_steps / fragments"
                )


@dataclass(frozen=True)
class Bandwidth:
    method: str
    mean_gbps: float
    peak_gbps: float
    bytes_per_step: float


def estimate_bandwidth(link: LinkSettings) -> tuple[Bandwidth, ...]:
    """Mean and peak Gbit/s per learner for data-parallel, DiLoCo (P = 1) and decoupled (P fragments)."""
    step = link.step_time_s
    dp_bits = link.params * link.bytes_per_value * 8
    outer_bits = link.params * link.quantizer_bits
    rows = [Bandwidth("data-parallel", dp_bits / step / 1e9, dp_bits / step / 1e9, dp_bits / 8)]
    fragment_counts = (1, link.fragments) if link.fragments > 1 else (1,)
    for p in fragment_counts:
        fragment_bits = outer_bits / p
        mean = outer_bits / (link.inner_steps * step)
        peak = fragment_bits / (link.overlap * step)
        name = "DiLoCo (P=1)" if p == 1 else f"decoupled (P={p})"
        rows.append(Bandwidth(name, mean / 1e9, peak / 1e9, outer_bits / link.inner_steps / 8))
    return tuple(rows)
