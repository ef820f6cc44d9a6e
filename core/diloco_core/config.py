"""Typed configuration shared by the synchronizer, the learners, the operator and the local runner.

Parsed once at each entry point (flags, environment, the operator's ConfigMap) and stored in
checkpoints. Field names are snake_case here; the custom resource uses camelCase aliases.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Quantizer = Literal["fp32", "bf16", "fp16", "int8", "int4", "e3m0"]
MergeRule = Literal["rda", "mean"]
FragmentStrategy = Literal["balanced", "strided"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DiLoCoSettings(_Model):
    """The algorithm's knobs (docs/algorithm.md §1 names them, §3 says what each does)."""

    inner_steps: int = Field(32, ge=1, description="H: inner steps between two syncs of one fragment")
    fragments: int = Field(4, ge=1, description="P: number of fragments the model is split into")
    overlap: int = Field(2, ge=0, description="tau: steps a sent fragment overlaps with training")
    quorum: int = Field(1, ge=1, description="K: minimum learners merged in a round")
    grace_gamma: float = Field(0.5, ge=0.0, le=1.0, description="gamma: share of the slack spent waiting")
    grace_cap_steps: float = Field(1.0, ge=0.0, description="upper bound of the grace window, in step times")
    outer_lr: float = Field(0.7, gt=0.0, le=10.0)
    outer_momentum: float = Field(0.9, ge=0.0, lt=1.0)
    delayed_nesterov: int = Field(0, ge=0, description="apply momentum every N merges (0: plain Nesterov)")
    codec: Quantizer = "int4"
    mixing_alpha: float = Field(0.0, ge=0.0, le=1.0, description="alpha: 0 overwrites local with global")
    merge_rule: MergeRule = "rda"
    token_weighting: bool = True
    staleness_power: float = Field(0.0, ge=0.0, description="weight x (1+staleness)^-power; 0 disables")
    max_staleness: int = Field(4, ge=0, description="versions behind the newest a contribution may be")
    heartbeat_timeout_s: float = Field(30.0, gt=0.0)
    fragment_strategy: FragmentStrategy = "balanced"

    @model_validator(mode="after")
    def _check(self) -> DiLoCoSettings:
        if self.overlap >= self.inner_steps:
            raise ValueError(f"overlap ({self.overlap}) must be smaller than inner_steps ({self.inner_steps})")
        return self


class ModelSettings(_Model):
    """Which model a learner trains: the built-in GPT or a user entry point ``module:function``."""

    entry_point: str = Field("builtin", description="'builtin' or 'package.module:function'")
    n_layer: int = Field(4, ge=1)
    n_head: int = Field(4, ge=1)
    n_embd: int = Field(128, ge=8)
    block_size: int = Field(128, ge=8, description="context length in tokens")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    seed: int = 0


class TrainSettings(_Model):
    """The learner's inner optimisation."""

    batch_size: int = Field(16, ge=1)
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(1e-3, gt=0.0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    warmup_steps: int = Field(50, ge=0)
    max_steps: int = Field(1000, ge=1, description="inner steps of this learner (schedule length)")
    weight_decay: float = Field(0.1, ge=0.0)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = Field(1.0, ge=0.0)


class DataSettings(_Model):
    corpus: str = Field("stdlib", description="'stdlib', a local folder/file, or s3://bucket/prefix")
    eval_fraction: float = Field(0.02, gt=0.0, lt=0.5)
    non_iid: bool = False


class StorageSettings(_Model):
    url: str = Field(..., description="file:///path or s3://bucket/prefix")
    endpoint_url: str | None = None
    region: str | None = None
    keep_versions: int = Field(4, ge=1)


class JobConfig(_Model):
    job_id: str = Field("local", min_length=1, max_length=63)
    diloco: DiLoCoSettings = DiLoCoSettings()
    model: ModelSettings = ModelSettings()
    train: TrainSettings = TrainSettings()
    data: DataSettings = DataSettings()
