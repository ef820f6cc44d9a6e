"""Typed configuration shared by the synchronizer, the learners, the operator and the local runner.

The one declaration of every setting: its name, type, default, range and description. The commands'
flags and ``DILOCO_*`` variables (``diloco_core.flags``) and the operator's custom resource
(``diloco_operator.schema.spec``, camelCase names) derive from these fields. Parsed once at each entry
point (flags, environment, the operator's ConfigMap) and stored in checkpoints.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from diloco_core.endpoint_url import EndpointUrl
from diloco_core.flags import Cli
from diloco_core.quantize import QuantizerName

Quantizer = QuantizerName  # the one list: diloco_core.quantize
MergeRule = Literal["rda", "mean"]
FragmentStrategy = Literal["balanced", "strided"]
# when a learner sends a fragment (docs/algorithm.md §3.2)
Schedule = Literal["fixed", "after-version"]
SCHEDULES: tuple[Schedule, ...] = get_args(Schedule)
# the learner's inner learning rate after its warm-up (``diloco_worker.train.lr_at``)
LrSchedule = Literal["cosine", "wsd", "constant"]
# the inner steps' arithmetic: 'auto' is bf16 autocast on CUDA and float32 elsewhere
Precision = Literal["auto", "bf16", "fp16", "fp32"]
# how the corpus is stored (``diloco_worker.tokens``): 'text' (bytes, or a tokenizer's ids), nanoGPT-style
# 'tokens' (.bin files of ids), 'parquet' (Parquet or Arrow files with a column of id lists)
DataFormat = Literal["text", "tokens", "parquet"]
TokenDtype = Literal["uint16", "uint32"]
# 'builtin', or 'package.module:function' (Python identifiers): what ``diloco_worker.entry`` resolves
ENTRY_POINT_PATTERN = r"^(builtin|[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*)$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# the DiLoCo settings a learner's fragment plan depends on (a learner builds its plan from them)
PLAN_FIELDS: tuple[str, ...] = ("inner_steps", "fragments", "overlap", "fragment_strategy")


class DiLoCoSettings(_Model):
    """The algorithm's knobs (docs/algorithm.md §1 names them, §3 says what each does)."""

    inner_steps: int = Field(16, ge=1, description="H: inner steps between two syncs of one fragment")
    fragments: int = Field(4, ge=1, description="P: number of fragments the model is split into")
    overlap: int = Field(2, ge=0, description="tau: steps a sent fragment overlaps with training")
    quorum: int = Field(1, ge=1, description="K: minimum learners merged in a round")
    grace_gamma: float = Field(0.5, ge=0.0, le=1.0, description="gamma: share of the slack spent waiting")
    grace_cap_steps: float = Field(1.0, ge=0.0, description="upper bound of the grace window, in step times")
    outer_lr: float = Field(
        0.6, gt=0.0, le=10.0, description="eta: learning rate of the outer Nesterov optimizer"
    )
    outer_momentum: float = Field(
        0.8, ge=0.0, lt=1.0, description="mu: momentum of the outer Nesterov optimizer"
    )
    delayed_nesterov: int = Field(0, ge=0, description="apply momentum every N merges (0: plain Nesterov)")
    outer_warmup: int = Field(
        16,
        ge=0,
        le=1_000_000,
        description="the outer learning rate rises linearly to outer_lr over a fragment's first this many "
        "outer steps (contributions with Delayed Nesterov); 0: no warm-up",
    )
    codec: Quantizer = Field("int2", description="quantization of the outer gradients on the wire")
    error_feedback: bool = Field(
        True,
        description="learners add each fragment's quantization residual to its next outer gradient "
        "(kept in their checkpoints); for int2, int1 and topk",
    )
    down_codec: Quantizer = Field(
        "int2",
        description="what goes down to the learners: fp32, every new version whole; otherwise the "
        "version's difference to the previous one in this quantization, with the synchronizer's error "
        "feedback (a learner that does not hold the previous version gets the whole version)",
    )
    mixing_alpha: float = Field(0.0, ge=0.0, le=1.0, description="alpha: 0 overwrites local with global")
    merge_rule: MergeRule = Field(
        "rda", description="how contributions are merged: radial-directional averaging or the weighted mean"
    )
    token_weighting: bool = Field(True, description="weight contributions by tokens x tokens per step")
    staleness_power: float = Field(0.0, ge=0.0, description="weight x (1+staleness)^-power; 0 disables")
    max_staleness: int = Field(4, ge=0, description="versions behind the newest a contribution may be")
    heartbeat_timeout_s: float = Field(
        30.0, gt=0.0, description="a learner silent for this long is not alive"
    )
    max_update_norm_factor: float = Field(
        10.0,
        ge=0.0,
        le=1e6,
        description="a contribution or merged update whose norm exceeds this many times the lower median of "
        "the fragment's recent ones is merged scaled down to that limit (0: only finiteness is checked)",
    )
    fragment_strategy: FragmentStrategy = Field(
        "balanced",
        description="packing of tensors into fragments: balanced sizes, or layer i in fragment i mod P",
    )
    schedule: Schedule = Field(
        "fixed",
        description="when a learner sends fragment p: 'fixed', at its steps t with t mod H = t_p whenever "
        "the merged version arrived (the papers' schedule), or 'after-version', H steps after its newest "
        "global version arrived",
    )

    @model_validator(mode="after")
    def _check(self) -> DiLoCoSettings:
        if self.overlap >= self.inner_steps:
            raise ValueError(
                f"overlap ({self.overlap}) must be smaller than inner_steps ({self.inner_steps})"
            )
        if self.fragments > self.inner_steps:
            raise ValueError(
                f"fragments ({self.fragments}) must be at most inner_steps ({self.inner_steps}): each fragment "
                "falls due at its own step offset p*H//P, and with more fragments than steps some would share one"
            )
        return self


class ModelSettings(_Model):
    """Which model a learner trains: the built-in GPT or a user entry point ``module:function``."""

    entry_point: str = Field(
        "builtin",
        pattern=ENTRY_POINT_PATTERN,
        description="what to train: 'builtin' (the byte-level GPT) or 'package.module:function', a "
        "function that receives a TaskContext and returns a TrainingTask or (model, loss_fn, "
        "make_batches); the module must be importable (installed or on PYTHONPATH). See docs/user-models.md",
    )
    n_layer: int = Field(4, ge=1, description="transformer layers of the built-in model")
    n_head: int = Field(4, ge=1, description="attention heads of the built-in model")
    n_embd: int = Field(128, ge=8, description="embedding width of the built-in model")
    block_size: int = Field(128, ge=8, description="context length in tokens")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout of the built-in model")
    seed: int = Field(0, description="seed of the initial parameters (the same on every learner)")
    vocab_size: int = Field(
        256,
        ge=2,
        le=2**32,
        description="vocabulary of the built-in model: 256 for the byte-level text "
        "corpus; with token data, more than the largest token id (a larger id stops the learner)",
    )

    @model_validator(mode="after")
    def _check(self) -> ModelSettings:
        if self.entry_point == "builtin" and self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head}): the built-in "
                "model splits the embedding width among the heads"
            )
        return self


class TrainSettings(_Model):
    """The learner's inner optimisation."""

    batch_size: int = Field(16, ge=1, description="sequences per micro-batch")
    grad_accum: int = Field(1, ge=1, description="micro-batches accumulated per inner step")
    lr: float = Field(1e-3, gt=0.0, description="peak inner learning rate")
    min_lr_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="the cosine and wsd schedules end at lr x this ratio"
    )
    warmup_steps: int = Field(50, ge=0, description="linear warm-up steps of the inner learning rate")
    lr_schedule: LrSchedule = Field(
        "cosine",
        description="the inner learning rate after the warm-up: 'cosine' decay to lr x min_lr_ratio "
        "at max_steps; 'wsd' (warmup-stable-decay) at lr, then linear to lr x min_lr_ratio over the last "
        "decay_fraction of max_steps; 'constant' at lr",
    )
    decay_fraction: float = Field(
        0.2, gt=0.0, le=1.0, description="share of max_steps the final decay of the wsd schedule takes"
    )
    max_steps: int = Field(1000, ge=1, description="inner steps of this learner (schedule length)")
    weight_decay: float = Field(0.1, ge=0.0, description="AdamW weight decay")
    beta1: float = Field(0.9, description="AdamW beta1")
    beta2: float = Field(0.95, description="AdamW beta2")
    grad_clip: float = Field(1.0, ge=0.0, description="gradient norm clipping of the inner steps (0: none)")
    precision: Precision = Field(
        "auto",
        description="arithmetic of the forward passes: 'bf16' or 'fp16' autocast (fp16 with a "
        "gradient scaler), 'fp32' none, 'auto' bf16 on CUDA and fp32 elsewhere",
    )
    checkpoint_every: int = Field(
        100,
        ge=0,
        description="steps between a learner's checkpoints, written in the background (one due "
        "while the previous is still being written is skipped); 0: only on SIGTERM and at the end",
    )
    checkpoints_kept: int = Field(2, ge=1, le=1000, description="a learner's newest checkpoints kept")


class DataSettings(_Model):
    """The training corpus."""

    corpus: str = Field("stdlib", description="'stdlib', a local folder/file, or s3://bucket/prefix")
    eval_fraction: float = Field(
        0.02, gt=0.0, lt=0.5, description="share of the corpus held out for evaluation"
    )
    non_iid: bool = Field(False, description="give each learner a distinct part of the corpus (non-IID data)")
    format: Annotated[DataFormat, Cli("data-format")] = Field(
        "text",
        description="how the corpus is stored: 'text' (read as bytes, or through --tokenizer), 'tokens' "
        "(nanoGPT-style .bin files of token ids), 'parquet' (Parquet or Arrow files, a Hugging Face dataset's "
        "to_parquet or save_to_disk, with a column of token id lists)",
    )
    token_dtype: TokenDtype = Field(
        "uint16",
        description="integer type of the ids in 'tokens' .bin files (nanoGPT writes uint16; vocabularies "
        "over 65536 need uint32)",
    )
    column: Annotated[str, Cli("data-column")] = Field(
        "input_ids", min_length=1, description="the 'parquet' column that holds each row's token ids"
    )
    eos_token: int | None = Field(
        None,
        ge=0,
        description="token id put between documents: between the rows of 'parquet' data (none when "
        "unset) and between the files of a tokenized text corpus (default: the tokenizer's end-of-text token)",
    )
    tokenizer: str | None = Field(
        None,
        description="a Hugging Face tokenizers tokenizer.json (a path or s3:// URL): the 'text' corpus is "
        "tokenized with it, file by file, instead of read as bytes",
    )
    cache_dir: Annotated[str | None, Cli("data-cache-dir")] = Field(
        None,
        description="where token data is kept locally: shards downloaded from S3 and parquet or tokenized "
        "text turned into token files (default: diloco-data under the system's temporary folder)",
    )
    sample_log: str | None = Field(
        None,
        description="a file where each learner process appends, per batch it draws of token data, one JSON "
        "line with the batch, its step and its samples' ids (for audits and tests; off by default)",
    )

    @model_validator(mode="after")
    def _check(self) -> DataSettings:
        if self.tokenizer and self.format != "text":
            raise ValueError(
                f"a tokenizer applies to a text corpus; format {self.format!r} already holds token ids: drop "
                "--tokenizer or use --data-format text"
            )
        return self


class TrackingSettings(_Model):
    """Where a job's learners and synchronizers send their scalars (``diloco_core.tracking``)."""

    tensorboard: str | None = Field(
        None,
        description="TensorBoard event files: a folder or an s3:// prefix (one run per learner and per "
        "synchronizer shard under it)",
    )
    wandb_project: str | None = Field(
        None,
        description="a Weights & Biases project (the wandb package; WANDB_API_KEY, WANDB_MODE=offline ...)",
    )
    mlflow_tracking_uri: str | None = Field(
        None,
        description="an MLflow tracking server or store (the mlflow package); the experiment is the job id",
    )
    flush_every_s: Annotated[float, Cli("tracking-flush-every")] = Field(
        10.0, gt=0.0, le=3600.0, description="seconds between flushes of the tracking sinks"
    )


class StorageSettings(_Model):
    """Where a job keeps its state."""

    url: str = Field(..., description="file:///path or s3://bucket/prefix")
    endpoint_url: EndpointUrl | None = Field(None, description="S3 endpoint (default: AWS_ENDPOINT_URL)")
    region: str | None = Field(None, description="S3 region (default: AWS_REGION)")
    keep_versions: int = Field(4, ge=1, description="fragment versions kept in storage")


class JobConfig(_Model):
    """Everything a job's synchronizers and learners share (the operator writes it to a ConfigMap)."""

    job_id: str = Field("local", min_length=1, max_length=63, description="the training job's id")
    diloco: DiLoCoSettings = DiLoCoSettings()
    model: ModelSettings = ModelSettings()
    train: TrainSettings = TrainSettings()
    data: DataSettings = DataSettings()
    tracking: TrackingSettings = TrackingSettings()
