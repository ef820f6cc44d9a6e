"""Fragment lookups answer with the protocol's errors; a plan must fit the job's settings."""

from __future__ import annotations

import pytest
from diloco_core.config import DiLoCoSettings, JobConfig
from diloco_sync.errors import ApiError
from diloco_sync.fragments import Fragments
from diloco_sync.settings import SyncSettings

from tests.synchronizer.helpers import tiny_plan


def shard(index: int) -> Fragments:
    job = JobConfig(diloco=DiLoCoSettings(fragments=2, inner_steps=4, overlap=1))
    return Fragments(
        SyncSettings(job=job, job_secret="x", storage_url="file:///x", shard_index=index, num_shards=2)
    )


def code_of(fragments: Fragments, p: int) -> tuple[int, str]:
    with pytest.raises(ApiError) as info:
        fragments.get(p)
    return info.value.status, info.value.code


def test_lookups_before_and_after_the_plan() -> None:
    fragments = shard(1)
    assert code_of(fragments, 1) == (409, "no_plan")
    assert fragments.versions() == {1: -1}
    fragments.adopt(tiny_plan())
    assert fragments.get(1).index == 1
    assert fragments.find(0) is None
    assert [fs.index for fs in fragments] == [1]
    assert code_of(fragments, 0) == (421, "wrong_shard")
    assert code_of(fragments, 2) == (404, "unknown_fragment")
    assert fragments.versions() == {1: -1}


def test_a_plan_that_does_not_fit_the_job_is_refused() -> None:
    fragments = shard(0)
    with pytest.raises(ApiError) as info:
        fragments.adopt(tiny_plan(inner_steps=8))
    assert (info.value.status, info.value.code) == (409, "plan_mismatch")
    assert fragments.plan is None
