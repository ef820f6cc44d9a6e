from __future__ import annotations

import pytest
import torch
from diloco_worker.distributed import UnitConfigError, join_unit, rank_from_env


def test_single_process_by_default() -> None:
    assert rank_from_env({}) == (0, 1)
    unit = join_unit({}, torch.device("cpu"))
    assert unit.is_leader
    assert not unit.distributed


def test_rank_from_env_or_the_statefulset_ordinal() -> None:
    assert rank_from_env({"WORLD_SIZE": "4", "RANK": "2"}) == (2, 4)
    assert rank_from_env({"WORLD_SIZE": "3", "HOSTNAME": "job-unit-a-2"}) == (2, 3)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"WORLD_SIZE": "x"}, "WORLD_SIZE must be an integer"),
        ({"WORLD_SIZE": "2", "HOSTNAME": "nopod"}, "needs RANK or a StatefulSet HOSTNAME"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "outside 0..1"),
    ],
)
def test_bad_unit_environment_is_explained(env: dict[str, str], message: str) -> None:
    with pytest.raises(UnitConfigError, match=message):
        rank_from_env(env)


def test_multi_process_unit_needs_the_leader_address() -> None:
    with pytest.raises(UnitConfigError, match="MASTER_ADDR"):
        join_unit({"WORLD_SIZE": "2", "RANK": "1"}, torch.device("cpu"))
