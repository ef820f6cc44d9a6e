"""Start-up: read the last committed state back from storage (blocking; run in a thread).

The storage prefix is claimed for the job first (``StateStore.claim``). What survives a crash:
every version named by the manifest (parameters and outer state), the learner registry, and every
contribution that was answered 202 while storage was up (it was written under ``pending/`` before
the answer). Pending contributions whose idempotency key the manifest lists as applied were merged
already: they are deleted, never replayed. The rest are replayed into the next round of their
fragment. The status's recent rounds are read back from the round logs, and learners that had left
cleanly stay left.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from diloco_core import codec
from diloco_core.fragments import FragmentPlan
from diloco_core.layout import FragmentRecord, LearnerRegistryRecord, contribution_key
from diloco_core.protocol import RoundRecord
from diloco_core.screening import tensors_norm

from .contribution import Arrays, Contribution
from .held_state import read_committed
from .merging import recent_round_keys, rounds_from_logs
from .persistence import StateStore

log = logging.getLogger(__name__)


@dataclass
class LoadedFragment:
    record: FragmentRecord
    params: Arrays
    payload: bytes
    outer: Arrays | None


@dataclass
class LoadedState:
    plan: dict[str, Any] | None = None
    learners: LearnerRegistryRecord = field(default_factory=LearnerRegistryRecord)
    fragments: dict[int, LoadedFragment] = field(default_factory=dict)
    pending: list[Contribution] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)  # the newest rounds, oldest first


def load_state(store: StateStore, owned: list[int], recent_rounds: int = 0) -> LoadedState:
    """The committed state, once the storage prefix is claimed for this job (``StateStore.claim``:
    nothing is read before, so a prefix of another job is refused before its state is looked at)."""
    store.claim()
    state = LoadedState(plan=store.load_plan(), learners=store.load_learners())
    manifest = store.load_manifest()
    if manifest is None or state.plan is None:
        return state
    plan = FragmentPlan.from_dict(state.plan)
    for p, record in manifest.fragments.items():
        if p not in owned:
            continue
        params, payload, outer = read_committed(store, plan.fragments[p], record.params_key, record.outer_key)
        state.fragments[p] = LoadedFragment(record, params, payload, outer)
    state.pending = _load_pending(store, plan, state.fragments, owned)
    if recent_rounds:
        versions = {p: lf.record.version for p, lf in state.fragments.items()}
        logs = store.load_round_logs(recent_round_keys(versions, recent_rounds))
        state.rounds = rounds_from_logs(logs, recent_rounds)
    return state


def _load_pending(
    store: StateStore, plan: FragmentPlan, fragments: dict[int, LoadedFragment], owned: list[int]
) -> list[Contribution]:
    out: list[Contribution] = []
    for key in store.list_pending():
        loaded = store.get_pending(key)
        if loaded is None:
            store.delete(key)
            continue
        meta, blob = loaded
        frag = fragments.get(meta.fragment)
        ckey = contribution_key(meta.learner_id, meta.fragment, meta.base_version, meta.seq)
        if meta.fragment not in owned or frag is None or ckey in frag.record.applied:
            store.delete(key)  # merged before the crash (or not ours): never apply twice
            continue
        try:
            tensors = codec.decode_quantized(blob, fragment=plan.fragments[meta.fragment]).tensors
            norm = tensors_norm(tensors)  # every tensor read once, as on arrival
        except codec.CodecError as exc:
            log.warning("dropping unreadable pending contribution %s: %s", key, exc)
            store.delete(key)
            continue
        out.append(Contribution.from_meta(meta, tensors, len(blob), key, norm=norm))
    out.sort(key=lambda c: (c.received_at, c.key))
    return out
