from pathlib import Path

import pytest
from diloco_core.auth import read_learner_token

from diloco.runner.capabilities import check_mode_supported
from diloco.runner.cli import main as run_main
from diloco.runner.cli import parse_settings
from diloco.runner.commands import (
    RunPaths,
    build_synchronizer_argv,
    build_worker_argv,
    build_worker_env,
    overridden_variables,
)
from diloco.runner.settings import SettingsError, parse_bandwidth, parse_rate, parse_slow, parse_speed_factors


def test_defaults_are_the_decoupled_mode_with_four_learners() -> None:
    s = parse_settings([])
    assert s.mode == "decoupled"
    assert s.learners == 4
    algo = s.algorithm()
    assert (algo.quorum, s.blocking_sync) == (1, False)
    assert algo.overlap == s.diloco.overlap > 0


def test_synchronous_modes_wait_for_every_learner() -> None:
    s = parse_settings(["--mode", "diloco-sync", "--learners", "3"])
    assert (s.algorithm().quorum, s.algorithm().overlap, s.blocking_sync) == (3, 0, True)
    # the ranks of the one unit are one learner to the synchronizer
    ddp = parse_settings(["--mode", "ddp", "--learners", "3"]).algorithm()
    assert (ddp.inner_steps, ddp.quorum, ddp.codec) == (1, 1, "fp32")
    # its outer step is a copy of the unit's model: nothing compressed, nothing warmed up
    flags = ["--down-codec", "int4", "--outer-warmup", "5", "--error-feedback"]
    ddp = parse_settings(["--mode", "ddp", *flags]).algorithm()
    assert (ddp.down_codec, ddp.outer_warmup, ddp.outer_lr, ddp.error_feedback) == ("fp32", 0, 1.0, False)
    decoupled = parse_settings(flags).algorithm()
    assert (decoupled.down_codec, decoupled.outer_warmup, decoupled.error_feedback) == ("int4", 5, True)
    assert parse_settings([]).algorithm().error_feedback is True  # the job's default
    assert parse_settings(["--no-error-feedback"]).algorithm().error_feedback is False
    # the overlap of the decoupled mode does not apply to the synchronous ones
    assert (
        parse_settings(["--mode", "diloco-sync", "--inner-steps", "2", "--fragments", "2"])
        .algorithm()
        .inner_steps
        == 2
    )
    with pytest.raises(SettingsError, match=r"fragments \(4\) must be at most inner_steps \(2\)"):
        parse_settings(
            ["--mode", "diloco-sync", "--inner-steps", "2"]
        )  # the fragments' offsets would collide


def test_the_learners_get_the_runs_model_and_schedule(tmp_path: Path) -> None:
    s = parse_settings(["--max-steps", "100", "--n-layer", "3", "--seed", "7", "--batch-size", "4"])
    argv = build_worker_argv(s, RunPaths(tmp_path), 0, sync_url="http://h:1")
    flags = {k: argv[i + 1] for i, k in enumerate(argv) if k.startswith("--") and i + 1 < len(argv)}
    assert (flags["--n-layer"], flags["--seed"], flags["--batch-size"]) == ("3", "7", "4")
    assert (flags["--max-steps"], flags["--warmup-steps"], flags["--inner-steps"]) == ("100", "10", "16")
    assert s.tokens_per_step == 4 * 64


def test_outer_optimizer_per_mode_reaches_the_synchronizer(tmp_path: Path) -> None:
    def sync_flags(argv: list[str]) -> dict[str, str]:
        cmd = build_synchronizer_argv(parse_settings(argv), RunPaths(tmp_path), port=1)
        return {
            k: cmd[i + 1]
            for i, k in enumerate(cmd)
            if k.startswith("--outer") or k in ("--delayed-nesterov", "--merge-rule")
        }

    # decoupled: Delayed Nesterov over one merge per learner by default
    assert sync_flags(["--learners", "3"]) == {
        "--outer-lr": "0.6",
        "--outer-momentum": "0.8",
        "--outer-warmup": "16",
        "--delayed-nesterov": "3",
        "--merge-rule": "rda",
    }
    assert sync_flags(["--delayed-nesterov", "0", "--outer-lr", "0.5"])["--delayed-nesterov"] == "0"
    assert sync_flags(["--delayed-nesterov", "0", "--outer-lr", "0.5"])["--outer-lr"] == "0.5"
    assert sync_flags(["--mode", "diloco-sync", "--learners", "3"])["--delayed-nesterov"] == "0"
    # ddp: the synchronizer's copy is the unit's model itself
    assert sync_flags(["--mode", "ddp"]) == {
        "--outer-lr": "1.0",
        "--outer-momentum": "0.0",
        "--outer-warmup": "0",
        "--delayed-nesterov": "0",
        "--merge-rule": "mean",
    }
    for bad, match in (
        (["--outer-lr", "0"], "--outer-lr"),
        (["--outer-momentum", "1"], "--outer-momentum"),
        (["--delayed-nesterov", "-1"], "--delayed-nesterov"),
    ):
        with pytest.raises(SettingsError, match=match):
            parse_settings(bad)


def test_error_feedback_and_the_grace_window_reach_the_synchronizer(tmp_path: Path) -> None:
    def argv(flags: list[str]) -> list[str]:
        return build_synchronizer_argv(parse_settings(flags), RunPaths(tmp_path), port=1)

    assert "--error-feedback" in argv(["--codec", "int2", "--error-feedback"])
    assert "--error-feedback" in argv(["--codec", "int2"])  # the default
    assert "--no-error-feedback" in argv(["--codec", "int2", "--no-error-feedback"])
    assert "--no-error-feedback" in argv(["--mode", "ddp", "--error-feedback"])  # nothing is quantized
    grace = argv(["--grace-gamma", "0.25", "--grace-cap-steps", "16"])
    assert grace[grace.index("--grace-gamma") + 1] == "0.25"
    assert grace[grace.index("--grace-cap-steps") + 1] == "16.0"


def test_speed_factors_and_slow_learners() -> None:
    assert parse_speed_factors("1,1,1.18,1.18", 4) == (1.0, 1.0, 1.18, 1.18)
    assert parse_slow("0.5:1.18", 4) == (1.0, 1.0, 1.18, 1.18)
    assert parse_slow("0.25:2", 4) == (1.0, 1.0, 1.0, 2.0)
    with pytest.raises(SettingsError, match="3 factors for 4 learners"):
        parse_speed_factors("1,1,2", 4)
    with pytest.raises(SettingsError, match="FRACTION:FACTOR"):
        parse_slow("half", 4)
    with pytest.raises(SettingsError, match=">= 1"):
        parse_settings(["--speed-factors", "1,0.5,1,1"])
    with pytest.raises(SettingsError, match="not both"):
        parse_settings(["--speed-factors", "1,1,1,1", "--slow", "0.5:2"])


def test_bandwidth_rates() -> None:
    assert parse_rate("500k") == 500_000
    assert parse_rate("1MiB") == 1024**2
    assert parse_rate("64kB/s") == 64_000
    assert parse_bandwidth("2M", 2) == (2e6, 2e6)
    assert parse_bandwidth("1M,-,200k", 3) == (1e6, None, 2e5)
    with pytest.raises(SettingsError, match="bytes per second"):
        parse_rate("fast")
    with pytest.raises(SettingsError, match="2 rates for 3 learners"):
        parse_bandwidth("1M,2M", 3)


def test_cross_field_checks_name_the_flag() -> None:
    with pytest.raises(SettingsError, match="--overlap"):
        parse_settings(["--overlap", "16", "--inner-steps", "16"])
    with pytest.raises(SettingsError, match="--n-embd"):
        parse_settings(["--n-embd", "66", "--n-head", "4"])


def test_worker_command_passes_speed_bandwidth_and_checkpointing(tmp_path: Path) -> None:
    s = parse_settings(["--learners", "2", "--speed-factors", "1,1.5", "--bandwidth-limit=-,300k"])
    paths = RunPaths(tmp_path)
    argv0 = build_worker_argv(s, paths, 0, sync_url="http://h:1")
    argv1 = build_worker_argv(s, paths, 1, sync_url="http://h:1")
    assert argv1[argv1.index("--speed-factor") + 1] == "1.5"
    assert argv1[argv1.index("--bandwidth-limit") + 1] == "300000.0"
    assert "--bandwidth-limit" not in argv0
    assert argv1[argv1.index("--learner-id") + 1] == "learner-1"
    assert "--checkpoint-every" in argv1
    assert not any("secret" in a for a in argv1)
    env = build_worker_env(s, 1, {"DILOCO_JOB_SECRET": "inherited"}, job_secret="s3cret", master_port=1)
    assert "DILOCO_JOB_SECRET" not in env  # a learner gets its own token, never the job secret
    claims = read_learner_token("s3cret", env["DILOCO_TOKEN"])
    assert claims is not None
    assert claims.learner == "learner-1"
    assert claims.tokens_per_step == s.train.batch_size * s.model.block_size * s.train.grad_accum
    assert "WORLD_SIZE" not in env


def test_ddp_learners_are_ranks_of_one_unit(tmp_path: Path) -> None:
    s = parse_settings(["--mode", "ddp", "--learners", "3"])
    argv = build_worker_argv(s, RunPaths(tmp_path), 2, sync_url="http://h:1")
    assert argv[argv.index("--learner-id") + 1] == "learner-0"
    env = build_worker_env(s, 2, {}, job_secret="x", master_port=2999)
    assert (env["WORLD_SIZE"], env["RANK"], env["MASTER_PORT"]) == ("3", "2", "2999")
    sync = build_synchronizer_argv(s, RunPaths(tmp_path), port=1)
    assert sync[sync.index("--quorum") + 1] == "1"
    assert sync[sync.index("--outer-lr") + 1] == "1.0"


def test_diloco_sync_mode_needs_blocking_learners() -> None:
    s = parse_settings(["--mode", "diloco-sync"])
    with pytest.raises(SettingsError, match="--blocking-sync"):
        check_mode_supported(s, help_text="usage: diloco worker [--sync-url URL]")
    check_mode_supported(s, help_text="usage: diloco worker [--blocking-sync]")
    check_mode_supported(parse_settings([]), help_text="")


def test_the_installed_worker_supports_the_synchronous_baseline() -> None:
    check_mode_supported(parse_settings(["--mode", "diloco-sync"]))  # reads the worker's real --help


def test_variables_a_flag_of_the_runs_own_command_lines_would_hide_are_named() -> None:
    argvs = [
        [
            "python",
            "-m",
            "diloco_worker",
            "--entry-point",
            "builtin",
            "--no-error-feedback",
            "--corpus=stdlib",
        ]
    ]
    environ = {"DILOCO_ENTRY_POINT": "nope:build", "DILOCO_ERROR_FEEDBACK": "true", "DILOCO_CORPUS": "/x",
               "DILOCO_LOG_LEVEL": "DEBUG", "DILOCO_SEED": "", "PATH": "/bin"}  # fmt: skip
    assert overridden_variables(environ, argvs) == [
        "DILOCO_CORPUS",
        "DILOCO_ENTRY_POINT",
        "DILOCO_ERROR_FEEDBACK",
    ]


def test_a_run_refuses_a_variable_it_would_ignore(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A user model asked for by a variable is not trained silently as the built-in one."""
    monkeypatch.setenv("DILOCO_ENTRY_POINT", "nope:build")
    assert run_main(["--max-steps", "5", "--runs-dir", str(tmp_path)]) == 2
    assert "DILOCO_ENTRY_POINT set" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing started


def test_every_process_of_a_run_tracks_to_the_run_folder_unless_told_elsewhere(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "20261127-101500")
    s = parse_settings([])
    for argv in (
        build_worker_argv(s, paths, 1, sync_url="http://h:1"),
        build_synchronizer_argv(s, paths, port=1),
    ):
        assert argv[argv.index("--tensorboard") + 1] == str(paths.tensorboard.resolve())
        assert argv[argv.index("--job-id") + 1] == "run-20261127-101500"
        assert "--wandb-project" not in argv
    s = parse_settings(["--tensorboard", "s3://b/tb", "--wandb-project", "p", "--tracking-flush-every", "3"])
    argv = build_worker_argv(s, paths, 0, sync_url="http://h:1")
    assert argv[argv.index("--tensorboard") + 1] == "s3://b/tb"
    assert argv[argv.index("--wandb-project") + 1] == "p"
    assert argv[argv.index("--tracking-flush-every") + 1] == "3.0"


def test_the_precision_and_the_schedule_of_a_run_reach_its_learners(tmp_path: Path) -> None:
    s = parse_settings(["--precision", "bf16", "--lr-schedule", "wsd", "--decay-fraction", "0.3"])
    argv = build_worker_argv(s, RunPaths(tmp_path), 0, sync_url="http://h:1")
    assert argv[argv.index("--precision") + 1] == "bf16"
    assert argv[argv.index("--lr-schedule") + 1] == "wsd"
    assert argv[argv.index("--decay-fraction") + 1] == "0.3"
    plain = build_worker_argv(parse_settings([]), RunPaths(tmp_path), 0, sync_url="http://h:1")
    assert plain[plain.index("--precision") + 1] == "auto"  # today's behaviour unless asked


def test_a_users_model_data_and_training_knobs_reach_the_learners_without_a_job_file(tmp_path: Path) -> None:
    """``diloco run`` takes the entry point, the data and the inner optimizer's knobs as flags (they were
    refused, and a user model or corpus needed a job file)."""
    s = parse_settings([
        "--entry-point", "my_models:build", "--vocab-size", "512", "--corpus", "/data/tokens", "--data-format",
        "tokens", "--token-dtype", "uint32", "--sample-log", "/tmp/s.jsonl", "--lr", "0.01", "--grad-accum", "2",
        "--warmup-steps", "3", "--grad-clip", "0.5", "--weight-decay", "0.05", "--min-lr-ratio", "0.2",
    ])  # fmt: skip
    assert (s.model.entry_point, s.model.vocab_size) == ("my_models:build", 512)
    assert (s.data.corpus, s.data.format, s.data.token_dtype) == ("/data/tokens", "tokens", "uint32")
    assert (s.train.lr, s.train.grad_accum, s.train.warmup_steps) == (0.01, 2, 3)  # a given warm-up stays
    argv = build_worker_argv(s, RunPaths(tmp_path), 1, sync_url="http://h:1")
    for flag, value in [("--entry-point", "my_models:build"), ("--vocab-size", "512"), ("--corpus", "/data/tokens"),
                        ("--data-format", "tokens"), ("--token-dtype", "uint32"), ("--sample-log", "/tmp/s.jsonl"),
                        ("--lr", "0.01"), ("--grad-accum", "2"), ("--warmup-steps", "3"), ("--grad-clip", "0.5"),
                        ("--weight-decay", "0.05"), ("--min-lr-ratio", "0.2")]:  # fmt: skip
        assert argv[argv.index(flag) + 1] == value, flag
    assert parse_settings(["--max-steps", "100"]).train.warmup_steps == 10  # the run's own default: a tenth
