"""Where a learner resumes from: its own checkpoints, or its unit leader's after the unit changed size.

A learner of one process checkpoints into its checkpoint folder ``D``; rank ``r`` of a unit of several
processes into ``D/rank-r``. Each pod has its own ``D`` (``<storage>/checkpoints/<pod name>``), and the
unit's leader (rank 0, pod ordinal 0) keeps its name whatever the unit's size, so its ``D`` holds both
layouts: ``D`` itself, written while the unit had one pod, and ``D/rank-0``, while it had several.
Every checkpoint records the size of the unit that wrote it (``unit_ranks``).

The unit resumes

- from each rank's own folder, as written (its data cursor and random generators kept), when every
  rank holds the newest step the leader has in either layout and the unit that wrote it had this size;
- otherwise from the leader's newest checkpoint, sent to every rank over the unit's process group, its
  data cursor rescaled to the unit's new size (:func:`resized_cursor`): a unit resized from one pod to
  several or back, a rank added, or a failure between the ranks' writes of one checkpoint.

Either way no step the unit trained and checkpointed is lost, and no training window is read twice.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

from diloco_core.storage import ObjectStore
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .checkpoint import (
    Checkpoint,
    common_step,
    list_checkpoints,
    load_at,
    newest_readable,
    open_checkpoint_store,
)
from .distributed import Unit

log = logging.getLogger("diloco_worker.resume")
CHECKPOINTS_SHARED = 8  # the newest checkpoint steps each rank offers when the unit agrees on one


def rank_folder(location: str, unit: Unit) -> str:
    """This process's checkpoint folder: ``location`` for a learner of one process, else ``rank-N`` in it."""
    return location.rstrip("/") + (f"/rank-{unit.rank}" if unit.distributed else "")


def resized_cursor(cursor: int, old_ranks: int, old_batch: int, new_ranks: int, new_batch: int) -> int:
    """The data cursor of each rank of a unit of ``new_ranks`` processes taking ``new_batch`` windows per
    micro-batch, after one of ``old_ranks`` processes of ``old_batch`` consumed ``cursor`` micro-batches
    each. The unit's ranks take turns along one sequence (rank ``r``'s batch ``i`` is the sequence's batch
    ``i * ranks + r``), so the unit has consumed ``cursor * old_ranks * old_batch`` windows; the new
    cursor starts at the first whole unit batch after them (a partial one is skipped, never re-read)."""
    if min(old_ranks, old_batch, new_ranks, new_batch) < 1 or cursor < 0:
        raise ValueError("ranks and batch sizes must be positive and the cursor non-negative")
    consumed = cursor * old_ranks * old_batch
    per_batch = new_ranks * new_batch
    return -(-consumed // per_batch)


def choose(own_step: int, own_matches: bool, lead_step: int) -> Literal["own", "lead", "none"]:
    """Whether the unit resumes from each rank's own checkpoint of ``own_step`` (the newest every rank
    holds; ``own_matches``: every rank read it, written by a unit of this size), from the leader's
    newest checkpoint of ``lead_step`` (in either layout), or starts afresh."""
    if own_step > 0 and own_step >= lead_step and own_matches:
        return "own"
    return "lead" if lead_step > 0 else "none"


def _existing_store(location: str) -> ObjectStore | None:
    """The store at ``location``; None for a local folder that does not exist (opening creates it)."""
    local = (
        location.removeprefix("file://") if location.startswith("file://") or "://" not in location else None
    )
    if local is not None and not Path(local).is_dir():
        return None
    return open_checkpoint_store(location)


def unit_checkpoint(location: str, unit: Unit, batch_size: int) -> tuple[ObjectStore, Checkpoint | None]:
    """This process's checkpoint store, and the checkpoint the unit resumes from (the same step on
    every rank; None: the unit starts afresh). Collective: every rank of the unit calls it."""
    store = open_checkpoint_store(rank_folder(location, unit))
    steps = list_checkpoints(store)[-CHECKPOINTS_SHARED:]
    own_step = common_step(unit.gather_ints(steps, CHECKPOINTS_SHARED))
    lead, lead_store = (None, None)
    if unit.is_leader:
        root = location.rstrip("/")
        other = _existing_store(f"{root}/rank-0" if not unit.distributed else root)
        lead, lead_store = newest_readable([store] if other is None else [store, other])
    lead_step = unit.share_int(lead.step if lead is not None else 0)
    own = None
    if own_step > 0 and own_step >= lead_step:
        same = lead is not None and lead_store is store and lead.step == own_step
        own = lead if same else load_at(store, own_step)
    matches = own is not None and own.meta.get("unit_ranks", unit.world_size) == unit.world_size
    choice = choose(own_step, unit.all_min(int(matches)) == 1, lead_step)
    if choice == "own":
        return store, own
    if choice == "none":
        return store, None
    shared = share_checkpoint(unit, lead)
    return store, resized(shared, unit.world_size, batch_size)


def share_checkpoint(unit: Unit, ckpt: Checkpoint | None) -> Checkpoint:
    """The leader's checkpoint on every rank (its meta as JSON, its tensors as safetensors: no pickle)."""
    meta = unit.share_bytes(json.dumps(ckpt.meta).encode() if ckpt is not None else b"")
    tensors = unit.share_bytes(st_save(ckpt.tensors) if ckpt is not None else b"")
    return Checkpoint(json.loads(meta), st_load(tensors))


def resized(ckpt: Checkpoint, ranks: int, batch_size: int) -> Checkpoint:
    """``ckpt`` with its data cursor for a unit of ``ranks`` processes of ``batch_size`` (unchanged when
    it was written by a unit of that shape)."""
    meta: dict[str, Any] = dict(ckpt.meta)
    old_ranks = meta.get("unit_ranks")
    old_batch = int(meta.get("config", {}).get("train", {}).get("batch_size", batch_size))
    loop = dict(meta["loop"])
    if old_ranks is None:
        log.warning(
            "checkpoint step %d does not record the size of the unit that wrote it: its data cursor %d is "
            "taken as it is",
            ckpt.step,
            loop["cursor"],
        )
    elif (old_ranks, old_batch) != (ranks, batch_size):
        cursor = resized_cursor(int(loop["cursor"]), int(old_ranks), old_batch, ranks, batch_size)
        log.info(
            "step=%d resumed from the unit leader's checkpoint, written by a unit of %d process(es) of batch "
            "%d, now %d of batch %d: data cursor %d -> %d",
            *(ckpt.step, old_ranks, old_batch, ranks, batch_size, loop["cursor"], cursor),
        )
        loop["cursor"] = cursor
    meta["loop"], meta["unit_ranks"] = loop, ranks
    return Checkpoint(meta, ckpt.tensors)
