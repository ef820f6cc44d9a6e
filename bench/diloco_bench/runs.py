"""What a run of the in-process harness is (a method, its timing) and what it measures."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Literal

from diloco_core.config import DiLoCoSettings, Quantizer

WIRE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


# The benchmarks' base settings: the job's (``DiLoCoSettings``) where it names them, else these, which the
# experiments measured before the job's defaults moved; ``product_defaults`` runs the job's own.
BENCH_SETTINGS = DiLoCoSettings(
    codec="int4",
    down_codec="fp32",
    error_feedback=False,
    outer_lr=0.7,
    outer_momentum=0.5,  # 0.9 in the papers' long runs; 0.5 does better over ~8 outer steps
    outer_warmup=0,
)


@dataclass(frozen=True)
class Method:
    """A way for learners to cooperate: a name and the job's settings (``DiLoCoSettings``, exactly as a
    job would set them), with what only the harness varies: data-parallel or DiLoCo, how many learners,
    whether they block on each merge, whether an open round pulls partial progress (``partial``: off by
    default so that the experiments measured without it keep their figures), the wire of data-parallel's
    gradients, and the block of the blocked quantizers (both directions; top-k keeps 8 values a block)."""

    name: str
    settings: DiLoCoSettings = BENCH_SETTINGS
    kind: Literal["dp", "diloco"] = "diloco"
    learners: int = 4
    blocking: bool = False
    partial: bool = False
    dp_wire: str = "fp32"
    block_size: int = 256

    def but(self, name: str | None = None, **changes: object) -> Method:
        """This method renamed and with some of its fields or settings changed (``quorum=0``: every
        learner); the settings are validated as a job's are."""
        own = {k: v for k, v in changes.items() if k in _METHOD_FIELDS}
        learners = own.get("learners", self.learners)
        asked = {k: v for k, v in changes.items() if k not in _METHOD_FIELDS}
        if asked.get("quorum") == 0:
            asked["quorum"] = learners
        settings = DiLoCoSettings.model_validate({**self.settings.model_dump(), **asked})
        return replace(self, name=name or self.name, settings=settings, **own)  # type: ignore[arg-type]


_METHOD_FIELDS = frozenset(f.name for f in fields(Method)) - {"name", "settings"}


def data_parallel(learners: int = 4, wire: str = "fp32") -> Method:
    return Method(f"data-parallel ({wire})", kind="dp", learners=learners, dp_wire=wire)


def diloco_sync(learners: int = 4, inner_steps: int = 16, wire: Quantizer = "fp32") -> Method:
    """Synchronous DiLoCo: K = M, P = 1, tau = 0, plain mean, learners wait for every merge."""
    return Method(f"DiLoCo sync ({wire})").but(
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
    name = str(kw.pop("name", f"decoupled ({wire})"))
    return Method(name).but(None, **{"learners": learners, "codec": wire, **kw})


def product_defaults(learners: int = 4) -> Method:
    """Decoupled DiLoCo at the job's defaults (``DiLoCoSettings()``, what the CRD, ``diloco run`` and the
    commands use when a job sets nothing)."""
    return Method("decoupled (defaults)", settings=DiLoCoSettings(), learners=learners)


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
    refused: int = (
        0  # contributions the synchronizer's in-order checks refused (the learner's progress dropped)
    )
    curve: list[tuple[int, float]] = field(default_factory=list)  # (tokens, held-out loss) along the way

    @property
    def bytes_per_token(self) -> float:
        return sum(self.bytes_up) / max(self.tokens, 1)
