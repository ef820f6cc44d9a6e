"""Command lines of the run's child processes (pure): the synchronizer and the learners."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from diloco.runner.settings import RunSettings

CORPUS = "stdlib"
EVAL_FRACTION = 0.02
HEARTBEAT_TIMEOUT_S = 6.0
HEARTBEAT_INTERVAL_S = 1.0
CHECKPOINT_EVERY = 10


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


def learner_id(settings: RunSettings, learner: int) -> str:
    """In ddp mode the learners are the ranks of one unit, which rank 0 represents."""
    return "learner-0" if settings.mode == "ddp" else f"learner-{learner}"


def storage_url(settings: RunSettings, paths: RunPaths) -> str:
    return settings.storage_url or f"file://{paths.storage.resolve()}"


def build_synchronizer_argv(settings: RunSettings, paths: RunPaths, *, port: int) -> list[str]:
    """The job secret travels in the environment (``DILOCO_JOB_SECRET``), never on a command line."""
    algo = settings.algorithm()
    argv = [
        settings.python, "-m", "diloco_sync",
        "--host", settings.host,
        "--port", str(port),
        "--storage", storage_url(settings, paths),
        "--inner-steps", str(algo.inner_steps),
        "--fragments", str(algo.fragments),
        "--overlap", str(algo.overlap),
        "--quorum", str(1 if settings.mode == "ddp" else algo.quorum),
        "--codec", algo.codec,
        "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S),
        "--heartbeat-interval-s", str(HEARTBEAT_INTERVAL_S),
        "--outer-lr", str(algo.outer_lr),
        "--outer-momentum", str(algo.outer_momentum),
        "--delayed-nesterov", str(algo.delayed_nesterov),
        "--merge-rule", algo.merge_rule,
    ]
    return argv


def build_worker_argv(settings: RunSettings, paths: RunPaths, learner: int, *, sync_url: str) -> list[str]:
    algo = settings.algorithm()
    m = settings.model
    argv = [
        settings.python, "-m", "diloco_worker",
        "--sync-url", sync_url,
        "--learner-id", learner_id(settings, learner),
        "--learner-index", str(0 if settings.mode == "ddp" else learner),
        "--num-learners", str(1 if settings.mode == "ddp" else settings.learners),
        "--inner-steps", str(algo.inner_steps),
        "--fragments", str(algo.fragments),
        "--overlap", str(algo.overlap),
        "--n-layer", str(m.n_layer),
        "--n-head", str(m.n_head),
        "--n-embd", str(m.n_embd),
        "--block-size", str(m.block_size),
        "--batch-size", str(m.batch_size),
        "--seed", str(settings.seed),
        "--max-steps", str(settings.max_steps),
        "--warmup-steps", str(min(20, settings.max_steps // 10)),
        "--corpus", CORPUS,
        "--eval-fraction", str(EVAL_FRACTION),
        "--checkpoint-dir", str(paths.checkpoint_dir(learner).resolve()),
        "--checkpoint-every", str(CHECKPOINT_EVERY),
        "--metrics-file", str(paths.metrics_file(learner).resolve()),
        "--eval-every", str(settings.eval_every),
        "--log-every", "5",
        "--device", "cpu",
        "--poll-wait", "2",
        "--speed-factor", str(settings.speed_of(learner)),
    ]
    if settings.mode == "diloco-sync":
        argv.append("--blocking-sync")
    bandwidth = settings.bandwidth_of(learner)
    if bandwidth is not None:
        argv += ["--bandwidth-limit", str(bandwidth)]
    return argv


def build_synchronizer_env(base: dict[str, str], *, job_secret: str) -> dict[str, str]:
    return dict(base) | {"DILOCO_JOB_SECRET": job_secret, "PYTHONUNBUFFERED": "1"}


def build_worker_env(
    settings: RunSettings, learner: int, base: dict[str, str], *, job_secret: str, master_port: int
) -> dict[str, str]:
    """Environment of a learner process: the job secret, one CPU thread each (they share the
    machine), and in ddp mode the torch.distributed rendezvous of the unit."""
    env = dict(base) | {
        "DILOCO_JOB_SECRET": job_secret, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
    }
    if settings.mode == "ddp":
        env |= {
            "WORLD_SIZE": str(settings.learners),
            "RANK": str(learner),
            "MASTER_ADDR": settings.host,
            "MASTER_PORT": str(master_port),
        }
    return env
