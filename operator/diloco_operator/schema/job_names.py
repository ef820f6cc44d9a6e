"""The names a job's children are made from: the job's, its units' and its synchronizer's (pure)."""

from __future__ import annotations

import re
from collections.abc import Sequence

JOB_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def sync_unit_names(shards: int, *, external: bool) -> list[str]:
    """Unit names that would give a unit the name of a synchronizer shard's Service (``J-sync``,
    ``J-sync-i``; none with an external synchronizer)."""
    if external:
        return []
    return ["sync", *(f"sync-{i}" for i in range(1, shards))]


def name_problems(name: str, units: Sequence[str], shards: int, *, external: bool) -> list[str]:
    """What in the job's and its units' names would make children the apiserver refuses, or two
    children of the same name."""
    out = []
    if not JOB_NAME.fullmatch(name):
        out.append(
            f"the job name '{name}' must be a DNS-1035 label (lower-case letters, digits and '-', "
            "starting with a letter and ending with a letter or digit): it names the job's Services"
        )
    dupes = sorted({n for n in units if units.count(n) > 1})
    if dupes:
        out.append(f"spec.learnerUnits: unit names must be unique, repeated: {', '.join(dupes)}")
    taken = sorted(set(units) & set(sync_unit_names(shards, external=external)))
    if taken:
        out.append(
            f"spec.learnerUnits: unit names {', '.join(taken)} are the synchronizer's own (its Services "
            f"are <job>-sync and <job>-sync-<shard>); choose other names"
        )
    return out
