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

from diloco_core import codec, downlink
from diloco_core.fragments import Fragment, FragmentPlan
from diloco_core.layout import FragmentRecord, LearnerRegistryRecord, contribution_key
from diloco_core.outer import OuterState
from diloco_core.protocol import RoundRecord
from diloco_core.screening import tensors_norm

from .contribution import Arrays, Contribution
from .fragment_state import FragmentState
from .held_state import read_committed
from .merging import recent_round_keys, rounds_from_logs
from .persistence import StateStore
from .publication import Served, Stored, served_form

log = logging.getLogger(__name__)


@dataclass
class LoadedFragment:
    """A committed version as the synchronizer takes it up: served from memory (its payload, with its
    parameters and outer state) or from storage (``publication.Stored``; params and outer None, read
    back by its next round). ``initial_digest``: of version 0's values."""

    record: FragmentRecord
    params: Arrays | None
    payload: Served
    outer: Arrays | None
    initial_digest: str | None = None


@dataclass
class LoadedState:
    plan: dict[str, Any] | None = None
    learners: LearnerRegistryRecord = field(default_factory=LearnerRegistryRecord)
    fragments: dict[int, LoadedFragment] = field(default_factory=dict)
    pending: list[Contribution] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)  # the newest rounds, oldest first


def load_state(
    store: StateStore, owned: list[int], in_memory_bytes: int, recent_rounds: int = 0
) -> LoadedState:
    """The committed state, once the storage prefix is claimed for this job (``StateStore.claim``:
    nothing is read before, so a prefix of another job is refused before its state is looked at).
    A version larger than ``in_memory_bytes`` is served from storage (``load_fragment``)."""
    store.claim()
    state = LoadedState(plan=store.load_plan(), learners=store.load_learners())
    manifest = store.load_manifest()
    if manifest is None or state.plan is None:
        return state
    plan = FragmentPlan.from_dict(state.plan)
    for p, record in manifest.fragments.items():
        if p not in owned:
            continue
        state.fragments[p] = load_fragment(store, plan.fragments[p], record, in_memory_bytes)
    state.pending = _load_pending(store, plan, state.fragments, owned)
    if recent_rounds:
        versions = {p: lf.record.version for p, lf in state.fragments.items()}
        logs = store.load_round_logs(recent_round_keys(versions, recent_rounds))
        state.rounds = rounds_from_logs(logs, recent_rounds)
    return state


def load_fragment(
    store: StateStore, spec: Fragment, record: FragmentRecord, in_memory_bytes: int
) -> LoadedFragment:
    """One committed version, holding in memory only what a version served from memory holds: one
    served from storage (larger than ``in_memory_bytes``) keeps no copy, as between its rounds, and
    is not read at all when the manifest records its size (version 0's digest aside), so a restart
    holds at most one large fragment at a time, not the model."""
    known = record.params_bytes
    if known is not None and known > in_memory_bytes and record.version > 0:
        return LoadedFragment(record, None, Stored(record.params_key, known), None)
    params, blob, outer = read_committed(store, spec, record.params_key, record.outer_key)
    digest = downlink.digest(params) if record.version == 0 else None
    payload = served_form(blob, record.params_key, in_memory_bytes)
    if isinstance(payload, Stored):
        return LoadedFragment(record, None, payload, None, digest)
    return LoadedFragment(record, params, payload, outer, digest)


def take_up(fs: FragmentState, lf: LoadedFragment, now: float, quorum: int) -> None:
    """The fragment's state starts from its committed version as loaded."""
    fs.restore(
        version=lf.record.version,
        params=lf.params,
        payload=lf.payload,
        outer=OuterState.from_arrays(lf.outer) if lf.outer is not None else OuterState(),
        initial_digest=lf.initial_digest,
        applied=lf.record.applied,
        rounds=lf.record.rounds,
        now=now,
        quorum=quorum,
        merged_through=lf.record.merged_through,
        norms=lf.record.norm_history(),
        version_times=lf.record.version_times,
        outer_key=lf.record.outer_key,
    )


def _load_pending(
    store: StateStore, plan: FragmentPlan, fragments: dict[int, LoadedFragment], owned: list[int]
) -> list[Contribution]:
    out: list[Contribution] = []
    store.sweep_uploads()
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
