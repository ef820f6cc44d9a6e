"""Where a unit resumes from: its own checkpoints, or its leader's after the unit changed size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from diloco_testbed.ports import free_port
from diloco_worker.resume import choose, resized_cursor


@pytest.mark.parametrize(
    ("cursor", "old_ranks", "old_batch", "new_ranks", "new_batch", "expected"),
    [
        (40, 1, 8, 2, 8, 20),  # one pod to two: the unit had read 320 windows
        (41, 1, 8, 2, 8, 21),  # a partial unit batch is skipped, never read again
        (30, 2, 8, 1, 8, 60),  # two pods to one
        (30, 3, 8, 2, 8, 45),
        (10, 1, 8, 1, 4, 20),  # the batch size changed
        (0, 2, 8, 1, 8, 0),
    ],
)
def test_the_data_cursor_continues_after_the_windows_the_unit_has_read(
    cursor: int, old_ranks: int, old_batch: int, new_ranks: int, new_batch: int, expected: int
) -> None:
    got = resized_cursor(cursor, old_ranks, old_batch, new_ranks, new_batch)
    assert got == expected
    assert got * new_ranks * new_batch >= cursor * old_ranks * old_batch


def test_a_resized_cursor_refuses_impossible_shapes() -> None:
    with pytest.raises(ValueError, match="positive"):
        resized_cursor(5, 0, 8, 1, 8)
    with pytest.raises(ValueError, match="non-negative"):
        resized_cursor(-1, 1, 8, 1, 8)


@pytest.mark.parametrize(
    ("own_step", "own_matches", "lead_step", "expected"),
    [
        (30, True, 30, "own"),  # every rank holds the leader's newest, written by a unit of this size
        (20, True, 30, "lead"),  # a failure between the ranks' writes of step 30
        (30, False, 30, "lead"),  # written by a unit of another size (or a rank could not read it)
        (0, False, 50, "lead"),  # resized from one pod: the ranks' folders are empty
        (20, True, 50, "lead"),  # resized back: the ranks' folders hold an older period's checkpoints
        (0, False, 0, "none"),
    ],
)
def test_the_unit_resumes_from_its_own_checkpoints_only_when_nothing_newer_exists(
    own_step: int, own_matches: bool, lead_step: int, expected: str
) -> None:
    assert choose(own_step, own_matches, lead_step) == expected


# Each process: a unit of WORLD_SIZE ranks whose checkpoint folder is ``<root>/pod-<rank>`` (each pod its
# own, as the operator gives them), after ``writes`` put checkpoints of the given steps and unit sizes
# into the given folders; it prints the step it resumes from, its data cursor and a digest of the tensors.
_RESUME = """
import hashlib, json, sys, torch
from safetensors.torch import save
from diloco_core.storage import FilesystemStore
from diloco_worker.distributed import join_unit
from diloco_worker.resume import unit_checkpoint

root, rank, world, port, writes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
for folder, step, ranks in json.loads(writes):
    store = FilesystemStore(f"{root}/{folder}")
    tensors = {"w": torch.full((3,), float(step + 100 * int(folder.endswith("rank-1"))))}
    meta = {"format": 1, "step": step, "unit_ranks": max(ranks, 1), "loop": {"step": step, "cursor": step},
            "config": {"train": {"batch_size": 8}}}
    blob = save(tensors) if ranks > 0 else b"not safetensors"  # a unit size of 0: a checkpoint that cannot be read
    store.put(f"ckpt-{step:010d}/tensors.safetensors", blob)
    store.put(f"ckpt-{step:010d}/meta.json", json.dumps(meta).encode())
env = {"WORLD_SIZE": str(world), "RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
unit = join_unit(env, torch.device("cpu"))
_, ckpt = unit_checkpoint(f"{root}/pod-{rank}", unit, 8)
if ckpt is None:
    print("RESUMED 0 - -")
else:
    print("RESUMED", ckpt.step, ckpt.meta["loop"]["cursor"], ckpt.tensors["w"].tolist()[0])
unit.close()
"""


def _resume(tmp_path: Path, world: int, writes: list[list[tuple[str, int, int]]]) -> list[str]:
    """What each of ``world`` real processes (a gloo group) resumes from; ``writes[r]``: what rank ``r``
    finds in storage first (folder under tmp_path, step, unit size of the writer)."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _RESUME,
                str(tmp_path),
                str(rank),
                str(world),
                port,
                json.dumps(writes[rank]),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, outputs
    return [out.split("RESUMED ")[-1].strip() for out in outputs]


@pytest.mark.integration
def test_a_unit_resized_from_one_pod_to_two_resumes_from_the_single_pods_checkpoint(tmp_path: Path) -> None:
    """Pod 0 checkpointed as a unit of one (its folder itself, cursor 40); both ranks now resume from
    that step with the same tensors and a cursor past the 320 windows read (40 x 1 x 8 = 20 x 2 x 8)."""
    got = _resume(tmp_path, 2, [[("pod-0", 40, 1)], []])
    assert got == ["40 20 40.0", "40 20 40.0"]


@pytest.mark.integration
def test_a_unit_resized_back_to_one_pod_takes_the_newer_checkpoint_of_its_two_pod_period(
    tmp_path: Path,
) -> None:
    """The single pod's own folder holds step 20 from before; the two-pod unit then reached step 64."""
    got = _resume(tmp_path, 1, [[("pod-0", 20, 1), ("pod-0/rank-0", 64, 2)]])
    assert got == ["64 128 64.0"]


@pytest.mark.integration
def test_a_unit_resized_twice_ignores_its_older_two_pod_checkpoints(tmp_path: Path) -> None:
    """Two pods (step 20 in each rank's folder), then one pod (step 50), now two pods again."""
    writes = [[("pod-0/rank-0", 20, 2), ("pod-0", 50, 1)], [("pod-1/rank-1", 20, 2)]]
    assert _resume(tmp_path, 2, writes) == ["50 25 50.0", "50 25 50.0"]


@pytest.mark.integration
@pytest.mark.parametrize(
    ("writes", "expected"),
    [
        # every rank holds step 30 of this unit: each its own (rank 1's tensors are its own)
        (
            [[("pod-0/rank-0", 20, 2), ("pod-0/rank-0", 30, 2)], [("pod-1/rank-1", 30, 2)]],
            ["30 30 30.0", "30 30 130.0"],
        ),
        # a failure between the ranks' writes of step 30: both take the leader's
        ([[("pod-0/rank-0", 20, 2), ("pod-0/rank-0", 30, 2)], [("pod-1/rank-1", 20, 2)]], ["30 30 30.0"] * 2),
        ([[], [("pod-1/rank-1", 10, 2)]], ["0 - -"] * 2),  # the leader has none: both start afresh
        # three pods to two: the checkpoints of step 30 were written by a unit of three
        ([[("pod-0/rank-0", 30, 3)], [("pod-1/rank-1", 30, 3)]], ["30 45 30.0"] * 2),
    ],
)
def test_the_ranks_of_a_unit_resume_from_the_same_step(
    tmp_path: Path, writes: list[list[tuple[str, int, int]]], expected: list[str]
) -> None:
    assert _resume(tmp_path, 2, writes) == expected


@pytest.mark.integration
def test_a_checkpoint_that_cannot_be_read_is_passed_over_for_the_next_older(tmp_path: Path) -> None:
    assert _resume(tmp_path, 1, [[("pod-0", 10, 1), ("pod-0", 20, 0)]]) == ["10 10 10.0"]
    writes = [
        [("pod-0/rank-0", 10, 2), ("pod-0/rank-0", 20, 0)],
        [("pod-1/rank-1", 10, 2), ("pod-1/rank-1", 20, 2)],
    ]
    assert _resume(tmp_path / "unit", 2, writes) == ["10 10 10.0", "10 10 10.0"]
