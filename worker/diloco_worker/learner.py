"""Assembles one learner process: device, unit, task, plan, checkpoint, DiLoCo session, training loop."""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

import torch
from diloco_core.fragments import FragmentPlan, build_plan
from diloco_core.storage import ObjectStore
from diloco_core.tracking import open_tracking

from .anchors import DeviceAnchors, build_anchor_store
from .checkpoint import Checkpoint, CheckpointWriter, restore, snapshot_checkpoint
from .credentials import TokenSource
from .data import Shard
from .dealing import UnitRanges
from .distributed import Unit, join_unit
from .entry import TaskContext, TrainingTask, load_task
from .fragment_state import FragmentState, Outgoing
from .hardware import peak_flops
from .health import Health
from .metrics import MetricsLog
from .model import flops_per_token
from .poller import Held
from .resume import unit_checkpoint
from .session import DiLoCoSession
from .settings import WorkerSettings
from .startup import FirstStep, StartupClock
from .sync_client import SyncClient, tls_verify
from .train import LoopHooks, LoopOptions, LoopState, make_optimizer, train

log = logging.getLogger("diloco_worker.learner")


def pick_device(name: str, env: Mapping[str, str]) -> torch.device:
    """``auto``: the GPU of this process (LOCAL_RANK) when CUDA is available, else the CPU."""
    if name == "auto":
        name = f"cuda:{env.get('LOCAL_RANK', '0')}" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def plan_for(task: TrainingTask, settings: WorkerSettings) -> FragmentPlan:
    named = [(n, tuple(p.shape)) for n, p in task.model.named_parameters()]
    names = {n for n, _ in named}
    return build_plan(
        named,
        settings.diloco.fragments,
        settings.diloco.inner_steps,
        settings.diloco.overlap,
        settings.diloco.fragment_strategy,
        embedding_names=[n for n in task.embedding_names if n in names],
    )


def _resume(
    ckpt: Checkpoint, task: TrainingTask, opt: torch.optim.Optimizer, fs: FragmentState, plan_hash: str
) -> tuple[LoopState, Held, list[Outgoing]]:
    """The loop state to go on from, the global versions the learner held exactly, and the outer
    gradients to send again first (those the synchronizer had not durably taken)."""
    if ckpt.meta.get("plan_hash") != plan_hash:
        raise ValueError(
            f"checkpoint at step {ckpt.step} was written for another fragment plan; "
            "use a fresh --checkpoint-dir or the job's original settings"
        )
    restore(ckpt, task.model, opt)
    fs.load_meta(ckpt.meta["fragments"], ckpt.anchors(), ckpt.residuals())
    loop: dict[str, Any] = ckpt.meta["loop"]
    return LoopState(**loop), ckpt.held(), ckpt.outgoing()


def _resume_if_any(
    settings: WorkerSettings,
    unit: Unit,
    task: TrainingTask,
    opt: torch.optim.Optimizer,
    fs: FragmentState,
    plan: FragmentPlan,
) -> tuple[ObjectStore | None, LoopState, Held, list[Outgoing]]:
    """The checkpoint store (one folder per rank in a multi-process unit), the state to start from,
    the global versions held exactly and the outer gradients to send again first (``resume``: a
    resized unit resumes from its leader's)."""
    if not settings.checkpoint_dir:
        return None, LoopState(), {}, []
    store, ckpt = unit_checkpoint(settings.checkpoint_dir, unit, settings.train.batch_size)
    if ckpt is None:
        return store, LoopState(), {}, []
    state, held, outgoing = _resume(ckpt, task, opt, fs, plan.hash())
    log.info("learner=%s step=%d resumed from checkpoint", settings.learner_id, state.step)
    return store, state, held, outgoing


def run_learner(
    settings: WorkerSettings,
    env: Mapping[str, str],
    stop: threading.Event,
    health: Health | None = None,
    startup: StartupClock | None = None,
) -> int:
    """Train until done or stopped; ``health`` receives the loop's beats (for the probe endpoint) and
    ``startup`` the end of each start-up phase (a clock from now when not given)."""
    clock = startup or StartupClock.from_now()
    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = pick_device(settings.device, env)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for the float32 matmuls outside autocast
    unit: Unit = join_unit(env, device)
    clock.mark("unit")
    try:
        return _run(settings, unit, stop, health or Health(settings.health_stale_s), clock)
    finally:
        unit.close()


def _run(
    settings: WorkerSettings, unit: Unit, stop: threading.Event, health: Health, clock: StartupClock
) -> int:
    shard = Shard(
        settings.learner_index,
        settings.num_learners,
        f"{settings.learner_id}/{unit.rank}",
        rank=unit.rank,
        ranks=unit.world_size,
    )
    ranges = _unit_ranges(settings, unit, stop)
    ctx = TaskContext(
        settings.model, settings.data, settings.train, shard, unit.device, settings.corpus_max_bytes, ranges
    )
    task = load_task(ctx)
    task.model.to(unit.device)
    clock.mark("task")
    plan = plan_for(task, settings)
    optimizer = make_optimizer(task.model, settings.train, settings.adamw)
    fs = FragmentState.for_model(
        plan,
        task.model,
        functools.partial(
            build_anchor_store,
            device=unit.device,
            compute=settings.sync_compute,
            placement=settings.anchor_memory,
        ),
    )
    clock.mark("optimizer")
    store, state, held, outgoing = _resume_if_any(settings, unit, task, optimizer, fs, plan)
    clock.mark("checkpoint")
    metrics = _open_metrics(settings) if unit.is_leader else None
    session = _open_session(settings, unit, stop, plan, fs, state, held, outgoing, ranges, metrics, health)
    clock.mark("register")
    log.info(
        "learner=%s rank=%d/%d device=%s params=%d fragments=%d outer gradients in %s",
        settings.learner_id,
        unit.rank,
        unit.world_size,
        unit.device,
        plan.num_params,
        len(plan.fragments),
        "torch on the device" if isinstance(fs.store, DeviceAnchors) else "numpy on the host",
    )
    saver = _Saver(store, task, optimizer, fs, plan, settings, session, unit) if store else None
    try:
        train(
            task,
            optimizer,
            settings.train,
            state,
            unit=unit,
            stop=stop,
            options=_loop_options(settings, task, unit),
            hooks=LoopHooks(
                FirstStep(session, clock, functools.partial(_report_startup, settings, metrics)),
                saver,
                metrics,
                health,
            ),
        )
    finally:
        health.beat("leaving")
        if saver is not None:
            saver.close()
        if session:
            session.close()
        if metrics is not None:
            metrics.close()
    return 0


def _open_session(
    settings: WorkerSettings,
    unit: Unit,
    stop: threading.Event,
    plan: FragmentPlan,
    fs: FragmentState,
    state: LoopState,
    held: Held,
    outgoing: list[Outgoing],
    ranges: UnitRanges | None,
    metrics: MetricsLog | None,
    health: Health,
) -> DiLoCoSession | None:
    """The learner's DiLoCo session, registered and holding the job's current global state (see
    :meth:`DiLoCoSession.connect`; ``held``, ``outgoing``: the checkpoint's global versions held
    exactly and outer gradients to send again); None for a learner without a synchronizer."""
    if settings.standalone:
        return None
    tokens_per_step = (
        settings.train.batch_size * settings.train.grad_accum * settings.model.block_size * unit.world_size
    )
    session = DiLoCoSession(
        settings,
        plan,
        fs,
        unit,
        tokens_per_step=tokens_per_step,
        stop=stop,
        metrics=metrics,
        health=health,
        client=ranges.client if ranges is not None else None,
    )
    session.connect(state, resumed=state.step > 0, held=held, outgoing=outgoing)
    return session


def _loop_options(settings: WorkerSettings, task: TrainingTask, unit: Unit) -> LoopOptions:
    return LoopOptions(
        checkpoint_every=settings.train.checkpoint_every,
        eval_every=settings.eval_every,
        log_every=settings.log_every,
        speed_factor=settings.speed_factor,
        stop_at_step=settings.stop_at_step,
        compile_model=settings.compile_model,
        flops_per_token=flops_per_token(task.model),
        peak_flops=peak_flops(unit.device, settings.peak_tflops),
    )


def _open_metrics(settings: WorkerSettings) -> MetricsLog | None:
    """The unit leader's metrics file and tracking (TensorBoard, W&B, MLflow), when either is set."""
    tracking = open_tracking(
        settings.tracking,
        run=settings.learner_id,
        group=settings.job_id,
        config=settings.model_dump(mode="json", include={"diloco", "model", "train", "data"}),
    )
    if not settings.metrics_file and not tracking:
        return None
    # the process id tells a reader where a restarted learner's records begin
    return MetricsLog(settings.metrics_file, tracking=tracking, learner=settings.learner_id, pid=os.getpid())


def _unit_ranges(settings: WorkerSettings, unit: Unit, stop: threading.Event) -> UnitRanges | None:
    """The unit's ranges of the job's data, dealt by the synchronizer (its leader asks, through the
    client its session uses too); None for a learner without a synchronizer."""
    if settings.standalone:
        return None
    client = None
    if unit.is_leader:
        assert settings.sync_url
        client = SyncClient(
            settings.sync_url,
            settings.learner_id,
            TokenSource(settings.token, settings.token_file),
            verify=tls_verify(settings.sync_ca_file),
        )
    return UnitRanges(client, unit, stop)


def _report_startup(
    settings: WorkerSettings, metrics: MetricsLog | None, clock: StartupClock, state: LoopState
) -> None:
    log.info("learner=%s %s", settings.learner_id, clock.describe())
    if metrics is not None:
        # the blocked time this process resumed with: what it adds is the record's blocked_s minus it
        metrics.note(**clock.to_record(), resumed_blocked_s=state.blocked_s)


class _Saver:
    """The training loop's checkpoints: the state copied on the training thread, written by a
    :class:`CheckpointWriter` in the background. For a learner of one process, a periodic checkpoint
    due while the previous one is still being written is skipped (the training thread never waits
    for storage; checkpoints come as often as they are asked for or as storage keeps up). The ranks
    of a multi-process unit always wait instead: they resume from a step that every rank holds.
    The final checkpoint waits, and so does :meth:`close`."""

    def __init__(
        self,
        store: ObjectStore,
        task: TrainingTask,
        opt: torch.optim.Optimizer,
        fs: FragmentState,
        plan: FragmentPlan,
        settings: WorkerSettings,
        session: DiLoCoSession | None,
        unit: Unit,
    ) -> None:
        self.task, self.opt, self.fs, self.plan, self.session = task, opt, fs, plan, session
        self.may_skip, self.ranks = not unit.distributed, unit.world_size
        self.config = settings.model_dump(mode="json", exclude={"token"})
        learner = settings.learner_id
        self.writer = CheckpointWriter(
            store,
            keep=settings.train.checkpoints_kept,
            on_written=lambda step: log.info("learner=%s step=%d checkpoint written", learner, step),
        )

    def __call__(self, state: LoopState, final: bool = False) -> None:
        if not self.writer.takes(final or not self.may_skip):
            log.debug("step=%d checkpoint skipped: the previous one is still being written", state.step)
            return
        meta = {
            "step": state.step,
            "loop": state.to_dict(),
            "fragments": self.fs.meta(),
            "plan_hash": self.plan.hash(),
            "config": self.config,
            "unit_ranks": self.ranks,
        }
        self.writer.submit(
            snapshot_checkpoint(
                model=self.task.model,
                optimizer=self.opt,
                anchors=self.fs.anchors,
                meta=meta,
                residuals=self.fs.residuals,
                held=self.session.held() if self.session is not None else None,
                outgoing=self.session.unacknowledged() if self.session is not None else None,
            )
        )

    def close(self) -> None:
        self.writer.close()
