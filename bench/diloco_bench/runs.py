"""What a run of the in-process harness is (a method, its timing) and what it measures."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from diloco_core.config import DiLoCoSettings, Quantizer, Schedule

WIRE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Method:
    """How the learners cooperate. ``quorum = 0`` means all learners (K = M)."""

    name: str
    kind: Literal["dp", "diloco"] = "diloco"
    learners: int = 4
    inner_steps: int = 16
    fragments: int = 4
    overlap: int = 2
    quorum: int = 1
    grace_gamma: float = 0.5
    grace_cap_steps: float = 1.0
    codec: Quantizer = "int4"
    merge_rule: Literal["rda", "mean"] = "rda"
    token_weighting: bool = True
    blocking: bool = False
    outer_lr: float = 0.7
    outer_momentum: float = 0.5  # 0.9 in the papers' long runs; 0.5 does better over ~8 outer steps
    delayed_nesterov: int = 0  # apply the outer momentum every N contributions (0: plain Nesterov)
    outer_warmup: int = 0  # outer steps over which the outer learning rate rises to outer_lr
    staleness_power: float = 0.0  # weight x (1 + staleness)^-power
    max_staleness: int = 4
    dp_wire: str = "fp32"
    # an open round pulls the partial progress of the other learners (never in blocking modes); off by
    # default so that the experiments measured without it keep their figures; ``hetero`` turns it on
    partial: bool = False
    error_feedback: bool = (
        False  # learners carry each fragment's quantization residual into its next outer gradient
    )
    schedule: Schedule = "fixed"  # the papers' (t mod H = t_p); or "after-version"
    down_codec: Quantizer = (
        "fp32"  # fp32: every new version whole; otherwise its quantized difference to the previous one
    )
    block_size: int = 256  # of the blocked quantizers, both directions (topk keeps 8 values per block)

    def settings(self) -> DiLoCoSettings:
        """The synchronizer's settings for this method (``quorum = 0``: every learner)."""
        return DiLoCoSettings(
            inner_steps=self.inner_steps,
            fragments=self.fragments,
            overlap=self.overlap,
            quorum=self.quorum or self.learners,
            grace_gamma=self.grace_gamma,
            grace_cap_steps=self.grace_cap_steps,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            delayed_nesterov=self.delayed_nesterov,
            outer_warmup=self.outer_warmup,
            codec=self.codec,
            down_codec=self.down_codec,
            merge_rule=self.merge_rule,
            token_weighting=self.token_weighting,
            staleness_power=self.staleness_power,
            max_staleness=self.max_staleness,
        )


def data_parallel(learners: int = 4, wire: str = "fp32") -> Method:
    return Method(f"data-parallel ({wire})", kind="dp", learners=learners, dp_wire=wire)


def diloco_sync(learners: int = 4, inner_steps: int = 16, wire: Quantizer = "fp32") -> Method:
    """Synchronous DiLoCo: K = M, P = 1, tau = 0, plain mean, learners wait for every merge."""
    return Method(
        f"DiLoCo sync ({wire})",
        learners=learners,
        inner_steps=inner_steps,
        fragments=1,
        overlap=0,
        quorum=0,
        grace_gamma=0.0,
        codec=wire,
        merge_rule="mean",
        token_weighting=False,
        blocking=True,
    )


def decoupled(learners: int = 4, wire: Quantizer = "int4", **kw: object) -> Method:
    """Decoupled DiLoCo: K = 1 + grace, token weights, RDA, P = 4 fragments, tau = 2."""
    return replace(Method(f"decoupled ({wire})", learners=learners, codec=wire), **kw)  # type: ignore[arg-type]


def product_defaults(learners: int = 4) -> Method:
    """Decoupled DiLoCo at the job's defaults (``DiLoCoSettings()``, what the CRD, ``diloco run`` and the
    commands use when a job sets nothing): the same settings, read from the one declaration."""
    s = DiLoCoSettings()
    return Method(
        "decoupled (defaults)",
        learners=learners,
        inner_steps=s.inner_steps,
        fragments=s.fragments,
        overlap=s.overlap,
        quorum=s.quorum,
        grace_gamma=s.grace_gamma,
        grace_cap_steps=s.grace_cap_steps,
        codec=s.codec,
        merge_rule=s.merge_rule,
        token_weighting=s.token_weighting,
        outer_lr=s.outer_lr,
        outer_momentum=s.outer_momentum,
        delayed_nesterov=s.delayed_nesterov,
        outer_warmup=s.outer_warmup,
        staleness_power=s.staleness_power,
        max_staleness=s.max_staleness,
        error_feedback=s.error_feedback,
        schedule=s.schedule,
        down_codec=s.down_codec,
    )


@dataclass(frozen=True)
class Timing:
    steps: int = 160  # inner steps per learner (ends the run unless time_budget ends it first)
    speed_factors: tuple[float, ...] = ()  # step-time multiplier per learner (default all 1.0)
    noise: float = 0.0  # relative std of each step time
    time_budget: float = math.inf  # virtual seconds
    eval_every: int = (
        0  # evaluate the global model every this many inner steps per learner (0: only at the end)
    )

    def factor(self, m: int) -> float:
        return self.speed_factors[m] if m < len(self.speed_factors) else 1.0


@dataclass
class RunResult:
    method: str
    seed: int
    eval_loss: float
    tokens: int
    virtual_time: float
    goodput: float  # busy / (busy + idle) learner-time
    merged_share: float  # learner-steps that reached the global model through a merge / all steps
    bytes_up: list[int]  # per learner, outer gradients or gradients sent
    peak_up: list[int]  # per learner, most bytes sent at one step boundary
    bytes_down: int  # global fragments delivered to learners, all learners
    steps: list[int]
    rounds: int = 0
    participants: float = 0.0  # mean learners per merge
    norm_ratios: list[float] = field(default_factory=list)  # ||merged|| / mean ||delta_m|| (>= 2 merged)
    wall_s: float = 0.0
    partials: int = 0  # partial outer gradients sent because a round asked for them
    curve: list[tuple[int, float]] = field(default_factory=list)  # (tokens, held-out loss) along the way

    @property
    def bytes_per_token(self) -> float:
        return sum(self.bytes_up) / max(self.tokens, 1)
