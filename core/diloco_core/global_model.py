"""The global model as a job's storage holds it: every fragment at the version its shard's manifest
names (``diloco export`` reads it; no synchronizer needs to run).

A shard's manifest is written last and atomically, so the versions one read of it names are a
committed state; their parameter objects are read after it. A running synchronizer may collect an
old version between the two reads: the shard is then read again from its manifest, a bounded number
of times. Across shards (each owns its fragments) the model is every shard's committed state.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

import numpy as np
from pydantic import ValidationError

from diloco_core import codec
from diloco_core.fragments import FragmentPlan
from diloco_core.layout import Layout, Manifest
from diloco_core.storage import ObjectNotFound, ObjectStore, StorageError

log = logging.getLogger(__name__)

_MANIFEST = re.compile(r"^shard-(\d{3})/manifest\.json$")
READ_ATTEMPTS = 5


class ExportError(RuntimeError):
    """The storage holds no complete global model (or not the job asked for)."""


@dataclass(frozen=True)
class GlobalModel:
    tensors: dict[str, np.ndarray]  # every tensor of the plan, float32
    versions: dict[int, int]  # per fragment, the committed version read
    job_id: str
    plan: FragmentPlan
    rounds: int  # merged rounds, all shards together


def shards_in(store: ObjectStore) -> list[int]:
    """The shards whose manifest the storage holds."""
    return sorted(int(m.group(1)) for key in store.list("shard-") if (m := _MANIFEST.match(key)))


def _shard_state(
    store: ObjectStore, shard: int
) -> tuple[Manifest, FragmentPlan, dict[int, dict[str, np.ndarray]]]:
    layout = Layout(shard)
    for attempt in range(READ_ATTEMPTS):
        try:
            manifest = Manifest.model_validate_json(store.get(layout.manifest))
            plan = FragmentPlan.from_dict(json.loads(store.get(layout.plan)))
            params = {}
            for p, record in manifest.fragments.items():
                if not 0 <= p < len(plan.fragments):
                    raise ExportError(
                        f"shard {shard}: manifest names fragment {p}, the plan has {len(plan.fragments)}"
                    )
                spec = plan.fragments[p]
                params[p] = codec.decode(store.get(record.params_key), fragment=spec).tensors
            return manifest, plan, params
        except ObjectNotFound:
            log.info("shard %d: a version was collected while it was read; reading it again", shard)
            if attempt == READ_ATTEMPTS - 1:
                raise
        except (ValidationError, ValueError, TypeError, KeyError, codec.CodecError) as exc:
            raise ExportError(
                f"shard {shard}: the stored state does not read as a synchronizer's: {exc}"
            ) from exc
    raise AssertionError("unreachable")


def read_global_model(store: ObjectStore, job_id: str | None = None) -> GlobalModel:
    """Every fragment of the job's model at its committed version; ``job_id`` (when given) must be
    the one the storage holds."""
    shards = shards_in(store)
    if not shards:
        raise ExportError(f"no synchronizer state under {store.describe()} (no shard-NNN/manifest.json)")
    tensors: dict[str, np.ndarray] = {}
    versions: dict[int, int] = {}
    plan: FragmentPlan | None = None
    jobs, rounds = set(), 0
    try:
        for shard in shards:
            manifest, shard_plan, params = _shard_state(store, shard)
            if plan is not None and shard_plan.hash() != plan.hash():
                raise ExportError(f"shard {shard} holds another fragment plan than shard {shards[0]}")
            plan, rounds = shard_plan, rounds + manifest.rounds
            jobs.add(manifest.job_id)
            for p, arrays in params.items():
                if p in versions:
                    raise ExportError(f"fragment {p} is committed by two shards")
                versions[p] = manifest.fragments[p].version
                tensors.update(arrays)
    except (ObjectNotFound, StorageError) as exc:
        raise ExportError(f"cannot read the job's state from {store.describe()}: {exc}") from exc
    assert plan is not None
    if len(jobs) != 1:
        raise ExportError(f"the storage holds the state of several jobs: {sorted(jobs)}")
    (stored_job,) = jobs
    if job_id is not None and job_id != stored_job:
        raise ExportError(f"the storage holds job {stored_job!r}, not {job_id!r}")
    missing = [f.index for f in plan.fragments if f.index not in versions]
    if missing:
        raise ExportError(f"fragments {missing} have no committed version yet: the job has not started them")
    return GlobalModel(tensors, versions, stored_job, plan, rounds)
