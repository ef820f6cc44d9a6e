from __future__ import annotations

from pathlib import Path

import pytest
from diloco_core.auth import learner_token
from diloco_worker.settings import SettingsError, data_shard, parse_settings


def test_missing_sync_url_is_named_with_how_to_set_it() -> None:
    with pytest.raises(SettingsError, match="DILOCO_SYNC_URL"):
        parse_settings(["--token", "t"], env={})


def test_missing_token_is_named_with_how_to_set_it() -> None:
    with pytest.raises(SettingsError, match="DILOCO_JOB_SECRET"):
        parse_settings(["--sync-url", "http://x"], env={})


def test_token_is_derived_from_the_job_secret() -> None:
    s = parse_settings(["--sync-url", "http://x", "--learner-id", "a-1"], env={"DILOCO_JOB_SECRET": "sec"})
    assert s.token == learner_token("sec", "a-1")


def test_flags_win_over_environment_which_wins_over_job_config() -> None:
    env = {
        "DILOCO_SYNC_URL": "http://env",
        "DILOCO_TOKEN": "t",
        "DILOCO_N_LAYER": "3",
        "DILOCO_LR": "0.01",
        "DILOCO_JOB_CONFIG": '{"model": {"n_layer": 6, "n_embd": 96}, "diloco": {"inner_steps": 7, "overlap": 1}}',
    }
    s = parse_settings(["--lr", "0.02"], env=env)
    assert s.sync_url == "http://env"
    assert s.model.n_layer == 3
    assert s.model.n_embd == 96
    assert s.train.lr == 0.02
    assert s.diloco.inner_steps == 7


def test_invalid_values_name_the_field() -> None:
    with pytest.raises(SettingsError, match="model.n_layer"):
        parse_settings(["--standalone", "--n-layer", "0"], env={})
    with pytest.raises(SettingsError, match="overlap"):
        parse_settings(["--standalone", "--inner-steps", "2", "--overlap", "2"], env={})
    with pytest.raises(SettingsError, match="learner index 3"):
        parse_settings(["--standalone", "--learner-index", "3", "--num-learners", "2"], env={})


def test_standalone_needs_no_synchronizer() -> None:
    s = parse_settings(["--standalone", "--non-iid"], env={})
    assert s.standalone
    assert s.data.non_iid
    assert s.sync_url is None


def test_blocking_sync_from_the_flag_or_the_environment() -> None:
    base = ["--sync-url", "http://x", "--token", "t"]
    assert not parse_settings(base, env={}).blocking_sync
    assert parse_settings([*base, "--blocking-sync"], env={}).blocking_sync
    assert parse_settings(base, env={"DILOCO_BLOCKING_SYNC": "true"}).blocking_sync
    assert not parse_settings(base, env={"DILOCO_BLOCKING_SYNC": "0"}).blocking_sync
    with pytest.raises(SettingsError, match="DILOCO_BLOCKING_SYNC='maybe'"):
        parse_settings(base, env={"DILOCO_BLOCKING_SYNC": "maybe"})


def test_blocking_sync_needs_a_synchronizer() -> None:
    with pytest.raises(SettingsError, match="--blocking-sync.*--standalone"):
        parse_settings(["--standalone", "--blocking-sync"], env={})


def test_health_port_is_off_unless_set_and_checked() -> None:
    assert parse_settings(["--standalone"], env={}).health_port is None
    assert parse_settings(["--standalone"], env={"DILOCO_HEALTH_PORT": "8081"}).health_port == 8081
    with pytest.raises(SettingsError, match="health_port"):
        parse_settings(["--standalone", "--health-port", "70000"], env={})


def test_the_data_shard_is_the_units_place_in_the_units_file(tmp_path: Path) -> None:
    units = tmp_path / "units.json"
    units.write_text('{"units": ["a", "big", "c"]}')
    base = ["--standalone", "--units-file", str(units)]
    assert data_shard(parse_settings([*base, "--unit", "big"], env={})) == (1, 3)
    assert data_shard(
        parse_settings(["--standalone", "--learner-index", "1", "--num-learners", "2"], env={})
    ) == (1, 2)
    with pytest.raises(SettingsError, match="unit 'gone' .* is not among the job's units"):
        data_shard(parse_settings([*base, "--unit", "gone"], env={}))
    units.write_text("{}")
    with pytest.raises(SettingsError, match="cannot read the job's units"):
        data_shard(parse_settings([*base, "--unit", "a"], env={}))
