"""A benchmark method is a name plus the job's settings: the harness runs exactly what a job would set."""

from __future__ import annotations

import pydantic
import pytest
from diloco_bench import runs
from diloco_core.config import DiLoCoSettings


def test_the_defaults_method_runs_the_jobs_own_settings() -> None:
    assert runs.product_defaults(3).settings == DiLoCoSettings()
    assert runs.product_defaults(3).learners == 3


def test_a_variant_changes_its_settings_and_its_own_fields_apart() -> None:
    base = runs.decoupled(4, inner_steps=8)
    assert (base.name, base.settings.codec, base.settings.inner_steps) == ("decoupled (int4)", "int4", 8)
    ef = base.but("int2 + error feedback", codec="int2", error_feedback=True, block_size=64)
    assert (ef.name, ef.settings.codec, ef.settings.error_feedback, ef.block_size) == (
        "int2 + error feedback", "int2", True, 64,
    )  # fmt: skip
    assert (ef.settings.inner_steps, base.settings.codec) == (8, "int4")  # the base is unchanged
    assert runs.decoupled(3, quorum=0).settings.quorum == 3  # quorum 0: every learner
    assert runs.diloco_sync(5).settings.quorum == 5


def test_a_variant_is_validated_as_a_job_is() -> None:
    with pytest.raises(pydantic.ValidationError):
        runs.decoupled(4).but(outer_momentum=1.5)
    with pytest.raises(pydantic.ValidationError):
        runs.decoupled(4).but(no_such_setting=1)
