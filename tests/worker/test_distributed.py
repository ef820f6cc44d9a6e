from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diloco_worker.distributed import UnitConfigError, join_unit, rank_from_env

from tests.worker.helpers import run_on_two_ranks


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


def test_a_ring_all_reduce_sends_two_n_minus_one_over_n_of_each_buffer() -> None:
    from diloco_worker.distributed import Collective

    c = Collective(reduced=1000)
    assert c.ring_bytes(1) == 0
    assert c.ring_bytes(2) == 1000
    assert c.ring_bytes(4) == 1500


_TERMS = """
import sys, torch
from diloco_worker.distributed import join_unit
from diloco_worker.handshake import JobTerms

rank = int(sys.argv[1])
unit = join_unit({"WORLD_SIZE": "2", "RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": sys.argv[2]}, torch.device("cpu"))
terms = JobTerms(alpha=0.3, schedule="after-version") if rank == 0 else JobTerms()  # only rank 0 registers
terms.share(unit)
print("TERMS", terms.alpha, terms.schedule)
unit.close()
"""


@pytest.mark.integration
def test_every_rank_of_a_unit_follows_the_terms_rank_0_registered_with(tmp_path: Path) -> None:
    """Only rank 0 registers; the others take its mixing alpha and schedule, or they would mix the
    arriving versions differently and the unit's replicas would drift apart."""
    outputs = run_on_two_ranks(_TERMS)
    assert [out.split("TERMS ")[-1].strip() for out in outputs] == ["0.3 after-version"] * 2, outputs


_SETS = """
import sys, torch
from diloco_worker.distributed import join_unit

rank = int(sys.argv[1])
unit = join_unit({"WORLD_SIZE": "2", "RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": sys.argv[2]}, torch.device("cpu"))
members = {0, 63, 64, 1000} if rank == 0 else {5}  # only rank 0's count
print("SET", sorted(unit.share_set(members, 1024)))
flags = [True, False, True] if rank == 0 else [False, False, False]
print("FLAGS", unit.share_flags(flags), unit.share_flags([]))
unit.close()
"""


@pytest.mark.integration
def test_rank_0s_set_of_fragments_arrives_whole_however_many_fragments_the_job_has() -> None:
    """A set of fragments past the width of one integer (the job may have up to 1024) reaches every
    rank of the unit whole."""
    outputs = run_on_two_ranks(_SETS)
    for out in outputs:
        assert "SET [0, 63, 64, 1000]" in out, outputs
        assert "FLAGS [True, False, True] []" in out, outputs


def test_a_single_process_unit_shares_its_own_set() -> None:
    from diloco_worker.distributed import Unit

    assert Unit().share_set({0, 63, 64, 1000}, 1024) == {0, 63, 64, 1000}
    assert Unit().share_flags([False, True]) == [False, True]
    with pytest.raises(ValueError, match="0..1023"):
        Unit().share_set({1024}, 1024)
