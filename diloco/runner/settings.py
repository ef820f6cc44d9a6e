"""The runner's typed settings, parsed once from the command line (pure parsing helpers here)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Mode = Literal["decoupled", "diloco-sync", "ddp"]
MODES: tuple[Mode, ...] = ("decoupled", "diloco-sync", "ddp")


class SettingsError(ValueError):
    """A flag value that can never work; the message says which flag and what to change."""


@dataclass(frozen=True)
class ModelShape:
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64
    batch_size: int = 8

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.block_size


@dataclass(frozen=True)
class AlgorithmSettings:
    """What the synchronizer is started with; derived from the mode and the flags."""

    inner_steps: int
    fragments: int
    overlap: int
    quorum: int
    codec: str
    strict_quorum: bool  # a dead learner is not dropped from the quorum: everyone waits for it
    blocking_sync: bool  # learners wait for each round's result before stepping on
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    delayed_nesterov: int = 0  # apply the momentum every N merges (0: plain Nesterov)
    merge_rule: str = "rda"


@dataclass(frozen=True)
class RunSettings:
    mode: Mode = "decoupled"
    learners: int = 4
    max_steps: int = 300
    token_budget: int | None = None
    time_limit_s: float = 900.0
    inner_steps: int = 16
    fragments: int = 4
    overlap: int = 2
    codec: str = "int4"
    model: ModelShape = field(default_factory=ModelShape)
    eval_every: int = 25
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    delayed_nesterov: int | None = None  # None: the number of learners in decoupled mode, else 0
    mtbf_s: float = 60.0
    repair_s: float = 8.0
    seed: int = 0
    speed_factors: tuple[float, ...] = ()
    bandwidth_limits: tuple[float | None, ...] = ()
    runs_dir: Path = Path("runs")
    storage_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    poll_interval_s: float = 0.5
    stop_timeout_s: float = 15.0
    plain: bool = False
    python: str = ""

    def speed_of(self, learner: int) -> float:
        return self.speed_factors[learner] if self.speed_factors else 1.0

    def bandwidth_of(self, learner: int) -> float | None:
        return self.bandwidth_limits[learner] if self.bandwidth_limits else None

    def algorithm(self) -> AlgorithmSettings:
        return build_algorithm(self)


def build_algorithm(s: RunSettings) -> AlgorithmSettings:
    """The synchronizer's settings for a mode: decoupled (K=1, grace, overlap), diloco-sync (K=all,
    no overlap, blocking) or ddp (every step, full precision, K=all, blocking).

    Decoupled mode uses Delayed Nesterov with N = the number of learners unless told otherwise:
    with K = 1 each learner's outer gradient is usually merged on its own, so plain Nesterov applies
    the momentum M times per "round" of M learners, which amplifies the step (Async Local-SGD, Liu et
    al. 2024); on the default run plain Nesterov's held-out loss went up and down between
    evaluations and ended near 3.4, Delayed Nesterov's fell steadily to about 2.6.
    """
    if s.mode == "decoupled":
        delayed = s.learners if s.delayed_nesterov is None else s.delayed_nesterov
        return AlgorithmSettings(s.inner_steps, s.fragments, s.overlap, 1, s.codec, False, False,
                                 s.outer_lr, s.outer_momentum, delayed)
    if s.mode == "diloco-sync":
        return AlgorithmSettings(s.inner_steps, s.fragments, 0, s.learners, s.codec, True, True,
                                 s.outer_lr, s.outer_momentum, s.delayed_nesterov or 0)
    # one unit whose ranks average gradients every step; the synchronizer only keeps the global
    # copy (and the checkpoint of record), so its outer step is a plain copy
    return AlgorithmSettings(1, 1, 0, s.learners, "fp32", True, True,
                             outer_lr=1.0, outer_momentum=0.0, delayed_nesterov=0, merge_rule="mean")


def parse_speed_factors(text: str, learners: int) -> tuple[float, ...]:
    """``1,1,1.18,1.18`` (one step-time multiplier per learner) → a tuple of ``learners`` factors."""
    try:
        factors = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise SettingsError(f"--speed-factors: expected comma-separated numbers, got {text!r}") from None
    if len(factors) != learners:
        raise SettingsError(f"--speed-factors: got {len(factors)} factors for {learners} learners")
    if any(f <= 0 for f in factors):
        raise SettingsError(f"--speed-factors: every factor must be > 0, got {text!r}")
    return factors


def parse_slow(text: str, learners: int) -> tuple[float, ...]:
    """``FRACTION:FACTOR`` (e.g. ``0.5:1.18``): the last ``round(FRACTION x learners)`` learners step
    ``FACTOR`` times slower, the others at full speed."""
    try:
        fraction_text, factor_text = text.split(":")
        fraction, factor = float(fraction_text), float(factor_text)
    except ValueError:
        raise SettingsError(f"--slow: expected FRACTION:FACTOR such as 0.5:1.18, got {text!r}") from None
    if not 0.0 <= fraction <= 1.0 or factor <= 0:
        raise SettingsError(f"--slow: FRACTION must be in [0, 1] and FACTOR > 0, got {text!r}")
    slow = round(fraction * learners)
    return tuple([1.0] * (learners - slow) + [factor] * slow)


_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "ki": 1024.0, "mi": 1024.0**2, "gi": 1024.0**3}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(k|m|g|ki|mi|gi)?b?(?:/s)?\s*$", re.IGNORECASE)


def parse_rate(text: str) -> float:
    """``500k``, ``2M``, ``1MiB``, ``64kB/s`` or ``123456`` (bytes per second) → bytes per second."""
    match = _RATE.match(text)
    if match is None:
        raise SettingsError(f"bandwidth {text!r}: expected bytes per second such as 500k, 2M or 1MiB")
    value = float(match.group(1)) * _UNITS[(match.group(2) or "").lower()]
    if value <= 0:
        raise SettingsError(f"bandwidth {text!r}: must be > 0")
    return value


def parse_bandwidth(text: str, learners: int) -> tuple[float | None, ...]:
    """One rate for every learner (``1M``) or one per learner (``1M,-,-,200k``; ``-`` = unlimited)."""
    parts = text.split(",")
    if len(parts) == 1:
        return (parse_rate(parts[0]),) * learners
    if len(parts) != learners:
        raise SettingsError(f"--bandwidth-limit: got {len(parts)} rates for {learners} learners")
    return tuple(None if p.strip() in ("-", "") else parse_rate(p) for p in parts)


def check_settings(s: RunSettings) -> None:
    """Cross-field checks that argparse cannot express."""
    if s.learners < 1:
        raise SettingsError("--learners must be >= 1")
    if s.max_steps < 1:
        raise SettingsError("--max-steps must be >= 1")
    if s.mode == "decoupled" and s.overlap >= s.inner_steps:
        raise SettingsError(f"--overlap ({s.overlap}) must be smaller than --inner-steps ({s.inner_steps})")
    if s.fragments < 1 or s.inner_steps < 1:
        raise SettingsError("--fragments and --inner-steps must be >= 1")
    if s.time_limit_s <= 0:
        raise SettingsError("--time-limit must be > 0 seconds")
    if s.mtbf_s < 0 or s.repair_s < 0:
        raise SettingsError("--mtbf and --repair must be >= 0 seconds")
    if not 0 < s.outer_lr <= 10:
        raise SettingsError(f"--outer-lr must be in (0, 10], got {s.outer_lr}")
    if not 0 <= s.outer_momentum < 1:
        raise SettingsError(f"--outer-momentum must be in [0, 1), got {s.outer_momentum}")
    if s.delayed_nesterov is not None and s.delayed_nesterov < 0:
        raise SettingsError(f"--delayed-nesterov must be >= 0 (0: plain Nesterov), got {s.delayed_nesterov}")
    if s.model.n_embd % s.model.n_head:
        raise SettingsError(f"--n-embd ({s.model.n_embd}) must be a multiple of --n-head ({s.model.n_head})")
