"""The options of scripts/local-cluster.py (``make cluster CLUSTER_ARGS=...``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "local-cluster.py"


@pytest.fixture(scope="module")
def script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("local_cluster", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_storage_no_namespace_gets_it(script: ModuleType) -> None:
    args = script.parse_args(["--images", "set.json"])
    assert (args.images, args.dir, args.storage) == ("set.json", None, [])


def test_storage_is_repeatable_and_comma_separated(script: ModuleType) -> None:
    args = script.parse_args(["--images", "set.json", "--storage", "default,jobs", "--storage", "team-a"])
    assert args.storage == ["default", "jobs", "team-a"]


def test_a_bad_namespace_is_refused_with_the_option_named(
    script: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        script.parse_args(["--images", "set.json", "--storage", "Jobs"])
    assert exit_info.value.code == 2
    assert "--storage: not namespace names" in capsys.readouterr().err


def test_kueue_is_off_unless_asked_for(script: ModuleType) -> None:
    assert script.parse_args(["--images", "set.json"]).kueue is False
    assert script.parse_args(["--images", "set.json", "--kueue", "--storage", "jobs"]).kueue is True
