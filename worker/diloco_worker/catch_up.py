"""The catch-up of a joining learner: the global version of every fragment newer than its own.

A fragment comes from the copy the learner already holds exactly when it can (its checkpoint's, or
its own initial parameters when they are the job's version 0) and the chain of updates from that
copy (``diloco_core.downlink``), else whole.
"""

from __future__ import annotations

import logging

import numpy as np
from diloco_core import downlink
from diloco_core.codec import decode
from diloco_core.fragments import Fragment

from .distributed import Arrivals
from .handshake import Handshake
from .poller import Held
from .sync_client import GlobalFragment

log = logging.getLogger("diloco_worker.session")


def first_globals(joined: Handshake, kept: Held, versions: dict[int, int]) -> Arrivals:
    """Every fragment's global version newer than what this learner has (waits for missing ones),
    through the shards ``joined`` registered with; ``kept``: the versions held exactly, from the
    checkpoint resumed."""
    out: Arrivals = {}
    for f in joined.plan.fragments:
        mine, theirs = joined.fs.counters[f.index].base_version, versions.get(f.index, -1)
        if theirs != -1 and theirs <= mine:
            continue
        held = kept.get(f.index)
        if mine < 0 and (own := _own_initial(joined, f.index, theirs)) is not None:
            held = (0, own)
            log.info("fragment=%d version=0 is this learner's initial parameters", f.index)
        got = _catch_up(joined, f, mine, theirs, held)
        if got is None:
            break
        out[f.index] = got
    return out


def _catch_up(
    joined: Handshake, f: Fragment, mine: int, theirs: int, held: tuple[int, dict[str, np.ndarray]] | None
) -> tuple[int, dict[str, np.ndarray]] | None:
    """Version ``theirs`` of fragment ``f`` or a newer one (the first version when ``theirs`` is
    -1): the copy ``held`` when it is that version, else the chain of updates from it, else the
    whole version; None when asked to stop first."""
    assert joined.shards is not None
    owner, wait = joined.shards.owner(f.index), joined.settings.poll_wait_s
    version, values = held if held is not None else (-1, {})
    taken = 0
    while not joined.stop.is_set():
        if version >= 0 and version >= theirs:
            if held is not None:
                log.info(
                    "fragment=%d version=%d from the copy held at version %d and %d update(s)",
                    f.index,
                    version,
                    held[0],
                    taken,
                )
            return version, values

        def fetch(v: int = version) -> GlobalFragment | None:
            got = owner.fetch(f.index, newer_than=v if v >= 0 else mine, wait_s=wait, have=v)
            return got if isinstance(got, GlobalFragment) else None

        got = joined.retry(f"fragment={f.index} first fetch", fetch)
        if got is None:
            continue
        payload = decode(got.payload, fragment=f)
        if payload.kind != "update":
            version, values, held = got.version, dict(payload.tensors), None
            continue
        made = downlink.apply_decoded(version, values, payload)
        version, values = made if made is not None else (-1, {})  # not for this copy: take it whole
        taken += 1
    return None


def _own_initial(joined: Handshake, p: int, theirs: int) -> dict[str, np.ndarray] | None:
    """A copy of this learner's parameters of fragment ``p`` (as built, never trained) when they are
    the job's version 0 bit for bit: it uploaded them, or they have the digest the synchronizer
    gave; else None."""
    if not ((theirs == -1 and p in joined.uploaded) or (theirs == 0 and p in joined.initial_digests)):
        return None
    own = {n: a.copy() for n, a in joined.fs.store.arrays(p).items()}
    return own if theirs == -1 or downlink.digest(own) == joined.initial_digests[p] else None
