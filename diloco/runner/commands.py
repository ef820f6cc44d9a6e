"""Command lines of the run's child processes (pure): the synchronizer and the learners.

Their settings go on the command line as the flags that the core's settings derive
(``diloco_core.flags``): the synchronizer's job takes every DiLoCo setting, a learner the model,
its inner optimisation, its data and the settings its fragment plan depends on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from diloco_core.auth import learner_token
from diloco_core.config import (
    PLAN_FIELDS,
    DataSettings,
    DiLoCoSettings,
    ModelSettings,
    TrackingSettings,
    TrainSettings,
)
from diloco_core.flags import ENV_PREFIX, derive_flags, to_argv

from diloco.job_file import setting_flags
from diloco.runner.settings import RunSettings

HEARTBEAT_INTERVAL_S = 1.0
CHECKPOINT_EVERY = 10
# bytes of the corpus each learner (and the evaluator) reads: the worker's default on CPUs, and on
# GPUs the whole standard library (about 30 MB), as a GPU-sized model takes far more tokens per step
CORPUS_BYTES = {"cpu": 4 * 1024 * 1024, "cuda": 48 * 1024 * 1024}
ALGORITHM_FLAGS = derive_flags(DiLoCoSettings, {"": None})
PLAN_FLAGS = derive_flags(DiLoCoSettings, {"": PLAN_FIELDS})
MODEL_FLAGS = derive_flags(ModelSettings, {"": None})
TRAIN_FLAGS = derive_flags(TrainSettings, {"": None})
DATA_FLAGS = derive_flags(DataSettings, {"": None})
TRACKING_FLAGS = derive_flags(TrackingSettings, {"": None})


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def storage(self) -> Path:
        return self.root / "storage"

    def checkpoint_dir(self, learner: int) -> Path:
        return self.root / "checkpoints" / f"learner-{learner}"

    def metrics_file(self, learner: int) -> Path:
        return self.root / "metrics" / f"learner-{learner}.jsonl"

    def log_file(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def job_id(self) -> str:
        """A run's default job id: ``run-<folder>``."""
        return f"run-{self.root.name}"[:63]


def run_job_id(settings: RunSettings, paths: RunPaths) -> str:
    """The run's job id (its storage's and its experiment's in tracking): the job file's, else the folder's."""
    return settings.job_id or paths.job_id


def run_tracking(settings: RunSettings, paths: RunPaths) -> TrackingSettings:
    """The run's tracking: TensorBoard in the run folder unless the settings name a place."""
    if settings.tracking.tensorboard:
        return settings.tracking
    return settings.tracking.model_copy(update={"tensorboard": str(paths.tensorboard.resolve())})


def learner_id(settings: RunSettings, learner: int) -> str:
    """In ddp mode the learners are the ranks of one unit, which rank 0 represents."""
    return "learner-0" if settings.mode == "ddp" else f"learner-{learner}"


def unit_tokens_per_step(settings: RunSettings, learner: int) -> int:
    """The most tokens a learner's step trains on, which its token declares: in ddp mode every rank's."""
    return settings.tokens_per_step_of(learner) * (settings.learners if settings.mode == "ddp" else 1)


def storage_url(settings: RunSettings, paths: RunPaths) -> str:
    return settings.storage_url or f"file://{paths.storage.resolve()}"


def build_synchronizer_argv(settings: RunSettings, paths: RunPaths, *, port: int) -> list[str]:
    """The job secret travels in the environment (``DILOCO_JOB_SECRET``), never on a command line."""
    return [
        settings.python,
        "-m",
        "diloco_sync",
        "--host",
        settings.host,
        "--port",
        str(port),
        "--storage",
        storage_url(settings, paths),
        "--heartbeat-interval-s",
        str(HEARTBEAT_INTERVAL_S),
        "--job-id",
        run_job_id(settings, paths),
        *to_argv(ALGORITHM_FLAGS, settings.algorithm()),
        *to_argv(TRACKING_FLAGS, run_tracking(settings, paths)),
        *setting_flags(settings.sync_memory.settings()),
    ]


def build_worker_argv(settings: RunSettings, paths: RunPaths, learner: int, *, sync_url: str) -> list[str]:
    argv = [
        settings.python,
        "-m",
        "diloco_worker",
        "--sync-url",
        sync_url,
        "--learner-id",
        learner_id(settings, learner),
        "--learner-index",
        str(0 if settings.mode == "ddp" else learner),
        "--num-learners",
        str(1 if settings.mode == "ddp" else settings.learners),
        *to_argv(PLAN_FLAGS, settings.algorithm()),
        *to_argv(MODEL_FLAGS, settings.model),
        *to_argv(
            TRAIN_FLAGS, settings.train.model_copy(update={"batch_size": settings.batch_size_of(learner)})
        ),
        *to_argv(DATA_FLAGS, settings.data),
        "--job-id",
        run_job_id(settings, paths),
        *to_argv(TRACKING_FLAGS, run_tracking(settings, paths)),
        "--corpus-max-bytes",
        str(CORPUS_BYTES[settings.device]),
        "--checkpoint-dir",
        str(paths.checkpoint_dir(learner).resolve()),
        "--checkpoint-every",
        str(CHECKPOINT_EVERY),
        "--metrics-file",
        str(paths.metrics_file(learner).resolve()),
        "--eval-every",
        str(settings.eval_every),
        # every step on a CPU, so the step a learner was killed at is the last one in its metrics file; on a
        # GPU every 5 (reading a step's loss waits for the device)
        "--log-every",
        "5" if settings.device == "cuda" else "1",
        "--device",
        "cuda:0" if settings.device == "cuda" else "cpu",  # on a GPU it sees only its own
        "--poll-wait",
        "2",
        "--speed-factor",
        str(settings.speed_of(learner)),
    ]
    if settings.mode == "diloco-sync":
        argv.append("--blocking-sync")
    if settings.compile_model:
        argv.append("--compile")
    bandwidth = settings.bandwidth_of(learner)
    if bandwidth is not None:
        argv += ["--bandwidth-limit", str(bandwidth)]
    return argv


def overridden_variables(environ: Mapping[str, str], argvs: Iterable[Sequence[str]]) -> list[str]:
    """The ``DILOCO_*`` variables set in ``environ`` that the run's processes would not read,
    because their command lines give the same setting as a flag (which wins over the variable):
    ``--entry-point`` hides ``DILOCO_ENTRY_POINT``, ``--error-feedback`` or ``--no-error-feedback``
    hide ``DILOCO_ERROR_FEEDBACK`` and ``DILOCO_NO_ERROR_FEEDBACK``."""
    hidden: set[str] = set()
    for argv in argvs:
        for arg in argv:
            if not arg.startswith("--"):
                continue
            name = arg[2:].split("=", 1)[0].removeprefix("no-").replace("-", "_").upper()
            hidden |= {f"{ENV_PREFIX}{name}", f"{ENV_PREFIX}NO_{name}"}
    return sorted(k for k, v in environ.items() if k in hidden and v != "")


def build_synchronizer_env(base: dict[str, str], *, job_secret: str) -> dict[str, str]:
    return dict(base) | {"DILOCO_JOB_SECRET": job_secret, "PYTHONUNBUFFERED": "1"}


def visible_device_id(base: dict[str, str], gpu: int) -> str:
    """What ``CUDA_VISIBLE_DEVICES`` names the runner's visible GPU ``gpu`` by (the runner's own
    ``CUDA_VISIBLE_DEVICES`` may already select and renumber the machine's GPUs)."""
    visible = base.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return str(gpu)
    return [x.strip() for x in visible.split(",")][gpu]


def build_worker_env(
    settings: RunSettings, learner: int, base: dict[str, str], *, job_secret: str, master_port: int
) -> dict[str, str]:
    """Environment of a learner process: its own learner token (never the job secret, so a learner
    cannot act as another), one CPU thread each (they share the machine), on GPUs the one GPU it
    sees (``CUDA_VISIBLE_DEVICES``), and in ddp mode the torch.distributed rendezvous of the unit."""
    env = {k: v for k, v in base.items() if k != "DILOCO_JOB_SECRET"} | {
        "DILOCO_TOKEN": learner_token(
            job_secret, learner_id(settings, learner), tokens_per_step=unit_tokens_per_step(settings, learner)
        ),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    gpu = settings.gpu_of(learner)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_device_id(base, gpu)
    if settings.mode == "ddp":
        env |= {
            "WORLD_SIZE": str(settings.learners),
            "RANK": str(learner),
            "MASTER_ADDR": settings.host,
            "MASTER_PORT": str(master_port),
        }
    return env
