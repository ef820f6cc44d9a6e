"""``diloco run``: a local job — one synchronizer and N learners on this machine, with chaos, a live
view and a report in ``runs/<timestamp>/``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from diloco_core.flags import add_flags, derive_flags, read, validate

from diloco.runner.commands import RunPaths
from diloco.runner.job_file import JobFile, read_job_file
from diloco.runner.settings import (
    GPU_BATCH_SIZE,
    GPU_MODEL,
    RunSettings,
    SettingsError,
    parse_bandwidth,
    parse_slow,
    parse_speed_factors,
    resolve_gpus,
)

# no environment: a local run's DILOCO_* variables are its children's business
FLAGS = derive_flags(
    RunSettings,
    {
        "": None,
        "diloco": (
            "inner_steps",
            "fragments",
            "overlap",
            "grace_gamma",
            "grace_cap_steps",
            "codec",
            "error_feedback",
            "down_codec",
            "outer_lr",
            "outer_momentum",
            "outer_warmup",
        ),
        "model": (
            "entry_point",
            "n_layer",
            "n_head",
            "n_embd",
            "block_size",
            "seed",
            "vocab_size",
            "dropout",
        ),
        "train": (
            "batch_size",
            "max_steps",
            "lr",
            "min_lr_ratio",
            "warmup_steps",
            "lr_schedule",
            "decay_fraction",
            "grad_accum",
            "grad_clip",
            "weight_decay",
            "precision",
        ),
        "data": None,
        "tracking": None,
    },
    exclude=(
        "speed_factors",
        "bandwidth_limits",
        "host",
        "poll_interval_s",
        "stop_timeout_s",
        "python",
        "sync_memory",
    ),
    help={
        "seed": "seed of the chaos schedule and the model",
        "max-steps": "inner steps per learner",
        "overlap": "tau: steps a sent fragment overlaps with training (decoupled mode)",
    },
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="diloco run", description=__doc__)
    add_flags(p, FLAGS)
    p.add_argument(
        "-f",
        "--file",
        type=Path,
        default=None,
        metavar="JOB_YAML",
        help="run the DiLoCoJob manifest that kubectl apply takes: each learner unit a local learner process "
        "(its pods as one process), the spec's model, data, training, DiLoCo and tracking settings; flags given "
        "beside it win (except --learners and --batch-size, which the units say)",
    )
    p.add_argument(
        "--resume",
        type=Path,
        default=None,
        metavar="RUN_DIR",
        help="continue a stopped run in its folder with its settings (no failures injected): each learner "
        "resumes from its newest checkpoint (step, optimizer, data position), the synchronizer from the "
        "stored state; only --time-limit and --plain may be given with it",
    )
    chaos = p.add_argument_group("heterogeneity")
    chaos.add_argument(
        "--speed-factors", default=None, help="step-time multiplier per learner, e.g. 1,1,1.18,1.18"
    )
    chaos.add_argument(
        "--slow", default=None, help="FRACTION:FACTOR, e.g. 0.5:1.18 slows the last half by 18%%"
    )
    chaos.add_argument(
        "--bandwidth-limit",
        default=None,
        help="upload rate of learners in bytes/s: one for all (500k) or one each (1M,-,-,200k)",
    )
    return p


def visible_gpus() -> int:
    """CUDA devices PyTorch sees in this process (loads PyTorch)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_settings(argv: list[str], count_gpus: Callable[[], int] = visible_gpus) -> RunSettings:
    return parse_run(argv, count_gpus)[0]


def parse_run(
    argv: list[str], count_gpus: Callable[[], int] = visible_gpus
) -> tuple[RunSettings, JobFile | None]:
    """The run's settings, and the job file they were read from (``-f``), if any."""
    a = build_parser().parse_args(argv)
    given = read(FLAGS, a, {})
    job = read_job_file(a.file) if a.file is not None else None
    if job is not None:
        set_by_units = [
            f.option
            for f in FLAGS
            if given.has(f.path) and f.path in (("learners",), ("train", "batch_size"))
        ]
        if set_by_units:
            raise SettingsError(
                f"-f {a.file}: {', '.join(set_by_units)} cannot be given: the job's learner units say"
            )
    if given.values.get("mode", "decoupled") != "decoupled":
        given.set(("diloco", "overlap"), 0, "--mode")  # no overlap in the synchronous modes
    if given.values.get("device") == "cuda":  # a GPU-sized model unless the flags say otherwise
        for path, value in [
            *((("model", k), v) for k, v in GPU_MODEL.items()),
            (("train", "batch_size"), GPU_BATCH_SIZE),
        ]:
            if not given.has(path) and not (job and path[1] in job.base.get(path[0], {})):
                given.set(path, value, "--device cuda")
    base = (
        {**job.base, "batch_sizes": job.batch_sizes, "job_file": str(a.file), "job_id": job.job_id}
        if job
        else None
    )
    settings = validate(RunSettings, given, base=base, base_source=f"-f {a.file}", what="run settings")
    settings = settings.model_copy(
        update={"gpus": resolve_gpus(settings, count_gpus() if settings.device == "cuda" else 0)}
    )
    if not given.has(("train", "warmup_steps")) and (job is None or "warmup_steps" not in job.base["train"]):
        warmup = min(20, settings.train.max_steps // 10)
        settings = settings.model_copy(
            update={"train": settings.train.model_copy(update={"warmup_steps": warmup})}
        )
    if a.speed_factors and a.slow:
        raise SettingsError("give either --speed-factors or --slow, not both")
    speeds: tuple[float, ...] = ()
    if a.speed_factors:
        speeds = parse_speed_factors(a.speed_factors, settings.learners)
    elif a.slow:
        speeds = parse_slow(a.slow, settings.learners)
    if any(f < 1.0 for f in speeds):
        raise SettingsError("speed factors must be >= 1 (a learner can be slowed down, not sped up)")
    bandwidth = parse_bandwidth(a.bandwidth_limit, settings.learners) if a.bandwidth_limit else ()
    out: RunSettings = settings.model_copy(
        update={"speed_factors": speeds, "bandwidth_limits": bandwidth, "python": sys.executable}
    )
    return out, job


SETTINGS_FILE = "settings.json"  # a run's settings, written at its start: what --resume continues with
RESUME_FLAGS = (("time_limit_s",), ("plain",))


def resume_settings(argv: list[str]) -> tuple[RunSettings, RunPaths] | None:
    """With ``--resume RUN_DIR``: the settings the run started with (no failures injected; a new
    ``--time-limit`` or ``--plain`` if given) and its folder; None without it."""
    a = build_parser().parse_args(argv)
    if a.resume is None:
        return None
    given = read(FLAGS, a, {})
    others = [f.option for f in FLAGS if given.has(f.path) and f.path not in RESUME_FLAGS]
    others += [
        f"--{n.replace('_', '-')}" for n in ("speed_factors", "slow", "bandwidth_limit") if getattr(a, n)
    ]
    if others:
        raise SettingsError(
            f"--resume continues a run with its own settings: {', '.join(others)} cannot be given"
        )
    saved = a.resume / SETTINGS_FILE
    if not saved.is_file():
        raise SettingsError(f"--resume {a.resume}: no {SETTINGS_FILE} there (not the folder of a diloco run)")
    try:
        settings = RunSettings.model_validate_json(saved.read_text())
    except ValueError as exc:
        raise SettingsError(
            f"--resume {a.resume}: {SETTINGS_FILE} does not read as a run's settings: {exc}"
        ) from None
    update: dict[str, object] = {"mtbf_s": 0.0}
    for path in RESUME_FLAGS:
        if given.has(path):
            update[path[0]] = getattr(validate(RunSettings, given, what="run settings"), path[0])
    return settings.model_copy(update=update), RunPaths(a.resume)


def new_run_paths(runs_dir: Path, now: float) -> RunPaths:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    root = runs_dir / stamp
    n = 1
    while root.exists():
        n += 1
        root = runs_dir / f"{stamp}-{n}"
    for sub in ("logs", "storage", "checkpoints", "metrics"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    return RunPaths(root)


def refuse_hidden_variables(settings: RunSettings, environ: Mapping[str, str]) -> None:
    """A ``DILOCO_*`` variable that a flag of the run's own command lines overrides would be
    ignored without a word: refused instead, naming the variable and what the run sets."""
    from diloco.runner.commands import build_synchronizer_argv, build_worker_argv, overridden_variables

    paths = RunPaths(Path(settings.runs_dir) / "_")
    argvs = [build_synchronizer_argv(settings, paths, port=0),
             *(build_worker_argv(settings, paths, i, sync_url="") for i in range(settings.learners))]  # fmt: skip
    hidden = overridden_variables(environ, argvs)
    if hidden:
        raise SettingsError(
            f"{', '.join(hidden)} set, but diloco run gives its synchronizer and learners that setting "
            "on their command lines (from its own flags), so the variable would be ignored: unset it, or "
            "use diloco run's flag where it has one"
        )


def main(argv: list[str]) -> int:
    try:
        resumed = resume_settings(argv)
        settings, job = (resumed[0], None) if resumed else parse_run(argv)
        from diloco.runner.capabilities import check_mode_supported

        check_mode_supported(settings)
        refuse_hidden_variables(settings, os.environ)
    except SettingsError as exc:
        print(f"diloco run: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from diloco.runner.orchestrator import Orchestrator, RunError
    from diloco.runner.report_files import write_report
    from diloco.runner.view import ProgressView

    if job is not None:
        units = ", ".join(f"learner-{i} = unit {u}" for i, u in enumerate(job.units))
        print(f"diloco run: job {job.name} from {settings.job_file}: {units}", flush=True)
        for note in job.notes:
            print(f"diloco run: note: {note}", flush=True)
    paths = resumed[1] if resumed else new_run_paths(settings.runs_dir, time.time())
    (paths.root / SETTINGS_FILE).write_text(settings.model_dump_json(indent=2) + "\n")
    with ProgressView(plain=settings.plain) as view:
        orchestrator = Orchestrator(settings, paths, view, resumed=resumed is not None)
        with orchestrator.catching_signals():  # from the first line on, Ctrl-C ends in a report
            where = f" on GPUs {','.join(map(str, settings.gpus))}" if settings.device == "cuda" else ""
            print(
                f"diloco run: {settings.mode}, {settings.learners} learners{where}; "
                f"{'resuming the run in' if resumed else 'run folder'} {paths.root}",
                flush=True,
            )
            try:
                record = orchestrator.run()
            except RunError as exc:
                print(f"diloco run: {exc}", file=sys.stderr)
                return 1
    report, markdown = write_report(record, paths.root)
    print(markdown)
    print(f"report: {paths.root / 'report.md'} (and report.json, loss.png)")
    return 130 if record.stop_reason.startswith("interrupted") else 0
