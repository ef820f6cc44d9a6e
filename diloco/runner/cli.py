"""``diloco run``: a local job — one synchronizer and N learners on this machine, with chaos, a live
view and a report in ``runs/<timestamp>/``."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from diloco.runner.commands import RunPaths
from diloco.runner.settings import (
    MODES,
    ModelShape,
    RunSettings,
    SettingsError,
    check_settings,
    parse_bandwidth,
    parse_slow,
    parse_speed_factors,
)


def build_parser() -> argparse.ArgumentParser:
    d = RunSettings()
    p = argparse.ArgumentParser(prog="diloco run", description=__doc__)
    p.add_argument("--mode", choices=MODES, default=d.mode,
                   help="decoupled (K=1, grace, overlap), diloco-sync (K=all, no overlap) or ddp (data-parallel every step)")
    p.add_argument("--learners", type=int, default=d.learners, help="learner processes (default %(default)s)")
    p.add_argument("--max-steps", type=int, default=d.max_steps, help="inner steps per learner (default %(default)s)")
    p.add_argument("--token-budget", type=int, default=None, help="stop once all learners processed this many tokens")
    p.add_argument("--time-limit", type=float, default=d.time_limit_s, help="stop after this many seconds")
    p.add_argument("--inner-steps", type=int, default=d.inner_steps, help="H (default %(default)s)")
    p.add_argument("--fragments", type=int, default=d.fragments, help="P (default %(default)s)")
    p.add_argument("--overlap", type=int, default=d.overlap, help="tau, decoupled mode (default %(default)s)")
    p.add_argument("--codec", default=d.codec, help="wire quantizer of outer gradients (default %(default)s)")
    p.add_argument("--n-layer", type=int, default=d.model.n_layer)
    p.add_argument("--n-head", type=int, default=d.model.n_head)
    p.add_argument("--n-embd", type=int, default=d.model.n_embd)
    p.add_argument("--block-size", type=int, default=d.model.block_size)
    p.add_argument("--batch-size", type=int, default=d.model.batch_size)
    p.add_argument("--outer-lr", type=float, default=d.outer_lr, help="outer Nesterov learning rate (default %(default)s)")
    p.add_argument("--outer-momentum", type=float, default=d.outer_momentum,
                   help="outer Nesterov momentum (default %(default)s)")
    p.add_argument("--delayed-nesterov", type=int, default=None,
                   help="apply the outer momentum every N merges, 0 for plain Nesterov (default: the "
                   "number of learners in decoupled mode, 0 otherwise)")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="learners' local evaluation interval in steps")
    chaos = p.add_argument_group("chaos and heterogeneity")
    chaos.add_argument("--mtbf", type=float, default=d.mtbf_s,
                       help="mean seconds between failures of each learner (exponential); 0 disables chaos")
    chaos.add_argument("--repair", type=float, default=d.repair_s, help="seconds a killed learner stays down")
    chaos.add_argument("--seed", type=int, default=d.seed, help="seed of the chaos schedule and the model")
    chaos.add_argument("--speed-factors", default=None, help="step-time multiplier per learner, e.g. 1,1,1.18,1.18")
    chaos.add_argument("--slow", default=None, help="FRACTION:FACTOR, e.g. 0.5:1.18 slows the last half by 18%%")
    chaos.add_argument("--bandwidth-limit", default=None,
                       help="upload rate of learners in bytes/s: one for all (500k) or one each (1M,-,-,200k)")
    out = p.add_argument_group("where and how")
    out.add_argument("--runs-dir", type=Path, default=d.runs_dir, help="parent of the run folder (default %(default)s)")
    out.add_argument("--storage", default=None, help="file:///path or s3://bucket/prefix (default: the run folder)")
    out.add_argument("--port", type=int, default=0, help="synchronizer port (default: a free one)")
    out.add_argument("--plain", action="store_true", help="plain progress lines even on a terminal")
    return p


def parse_settings(argv: list[str]) -> RunSettings:
    a = build_parser().parse_args(argv)
    speeds: tuple[float, ...] = ()
    if a.speed_factors and a.slow:
        raise SettingsError("give either --speed-factors or --slow, not both")
    if a.speed_factors:
        speeds = parse_speed_factors(a.speed_factors, a.learners)
    elif a.slow:
        speeds = parse_slow(a.slow, a.learners)
    if any(f < 1.0 for f in speeds):
        raise SettingsError("speed factors must be >= 1 (a learner can be slowed down, not sped up)")
    settings = RunSettings(
        mode=a.mode, learners=a.learners, max_steps=a.max_steps, token_budget=a.token_budget,
        time_limit_s=a.time_limit, inner_steps=a.inner_steps, fragments=a.fragments, overlap=a.overlap,
        codec=a.codec,
        model=ModelShape(n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, block_size=a.block_size, batch_size=a.batch_size),
        eval_every=a.eval_every, outer_lr=a.outer_lr, outer_momentum=a.outer_momentum,
        delayed_nesterov=a.delayed_nesterov, mtbf_s=a.mtbf, repair_s=a.repair, seed=a.seed, speed_factors=speeds,
        bandwidth_limits=parse_bandwidth(a.bandwidth_limit, a.learners) if a.bandwidth_limit else (),
        runs_dir=a.runs_dir, storage_url=a.storage, port=a.port, plain=a.plain, python=sys.executable,
    )
    check_settings(settings)
    return settings


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


def main(argv: list[str]) -> int:
    try:
        settings = parse_settings(argv)
        from diloco.runner.capabilities import check_mode_supported

        check_mode_supported(settings)
    except SettingsError as exc:
        print(f"diloco run: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from diloco.runner.orchestrator import Orchestrator, RunError
    from diloco.runner.report_files import write_report
    from diloco.runner.view import ProgressView

    paths = new_run_paths(settings.runs_dir, time.time())
    with ProgressView(plain=settings.plain) as view:
        orchestrator = Orchestrator(settings, paths, view)
        with orchestrator.catching_signals():  # from the first line on, Ctrl-C ends in a report
            print(f"diloco run: {settings.mode}, {settings.learners} learners; run folder {paths.root}", flush=True)
            try:
                record = orchestrator.run()
            except RunError as exc:
                print(f"diloco run: {exc}", file=sys.stderr)
                return 1
    report, markdown = write_report(record, paths.root)
    print(markdown)
    print(f"report: {paths.root / 'report.md'} (and report.json, loss.png)")
    return 130 if record.stop_reason.startswith("interrupted") else 0
