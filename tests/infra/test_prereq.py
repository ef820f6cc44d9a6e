"""A missing test prerequisite fails the test, and is skipped only on an explicit opt-out outside CI."""

from __future__ import annotations

from pathlib import Path

import pytest
from diloco_testbed.prereq import BUILD_HINT, bin_dir, require_binary, unavailable


@pytest.mark.parametrize(
    ("ci", "opt_out", "outcome"),
    [
        (None, None, pytest.fail.Exception),
        (None, "1", pytest.skip.Exception),
        ("true", "1", pytest.fail.Exception),
        (None, "yes", pytest.fail.Exception),
    ],
)
def test_policy(monkeypatch: pytest.MonkeyPatch, ci: str | None, opt_out: str | None, outcome: type) -> None:
    for name, value in (("CI", ci), ("DILOCO_TEST_SKIP_MISSING", opt_out)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with pytest.raises(outcome, match="install foo"):
        unavailable("install foo")


def test_missing_binary_names_the_build_script(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DILOCO_TEST_BIN_DIR", str(tmp_path))
    monkeypatch.delenv("DILOCO_TEST_SKIP_MISSING", raising=False)
    assert bin_dir() == tmp_path
    with pytest.raises(pytest.fail.Exception) as info:
        require_binary("kube-apiserver")
    assert BUILD_HINT in str(info.value)
    assert str(tmp_path) in str(info.value)
