"""The outer gradients a checkpoint holds because the synchronizer had not durably taken them.

Taking an outer gradient moves its fragment's counters and anchor to the sent point, so a checkpoint
records it as sent while it may still wait in the sender's queue, be on the wire, or be held by the
synchronizer only in memory. A learner that restarts from that checkpoint sends those parts again,
first and in order, as they were encoded: the synchronizer takes one it lacks, answers ``duplicate`` to
one it has, and the learner's next part continues where they end.

In a checkpoint (rank 0 of a unit, the process that sends, writes them): ``meta.json``'s ``outgoing``
lists each part's fragment, base version, steps, tokens, sequence number, ``since`` and quantizer, and
``tensors.safetensors`` holds its payload as ``outgoing/<fragment>/<seq>`` (uint8, compressed as sent).
A checkpoint without them resumes as before.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .fragment_state import Outgoing, StoredPayload

log = logging.getLogger("diloco_worker.checkpoint")
KEPT_PER_FRAGMENT = 8  # parts kept per fragment, the oldest: progress after them is fetched again


@dataclass(frozen=True)
class Unacknowledged:
    """The parts not durably taken when a checkpoint was taken, and the quantizer they go out in."""

    quantizer: str
    parts: tuple[Outgoing, ...] = ()


def kept_parts(parts: Iterable[Outgoing], per_fragment: int = KEPT_PER_FRAGMENT) -> list[Outgoing]:
    """The oldest ``per_fragment`` parts of each fragment, per fragment in sequence order (a later
    part without the ones before it would be refused as out of order)."""
    ordered = sorted(parts, key=lambda c: (c.fragment, c.seq))
    counts: dict[int, int] = {}
    kept = []
    for c in ordered:
        counts[c.fragment] = counts.get(c.fragment, 0) + 1
        if counts[c.fragment] <= per_fragment:
            kept.append(c)
    return kept


def encode_parts(outgoing: Unacknowledged) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """The payload tensors and the ``meta.json`` records of the parts kept. A part whose payload cannot
    be built is left out with the later parts of its fragment (progress fetched again on resume)."""
    tensors: dict[str, torch.Tensor] = {}
    records: list[dict[str, Any]] = []
    failed: set[int] = set()
    for c in kept_parts(outgoing.parts):
        if c.fragment in failed:
            continue
        try:
            blob = c.encode(outgoing.quantizer)
        except Exception as exc:
            log.warning(
                "fragment=%d version=%d part %d not checkpointed (its payload failed: %s)",
                c.fragment,
                c.base_version,
                c.seq,
                exc,
            )
            failed.add(c.fragment)
            continue
        tensors[f"outgoing/{c.fragment}/{c.seq}"] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        records.append(
            {
                "fragment": c.fragment,
                "base_version": c.base_version,
                "steps": c.steps,
                "tokens": c.tokens,
                "seq": c.seq,
                "since": c.since,
                "quantizer": outgoing.quantizer,
            }
        )
    return tensors, records


def decode_parts(records: Sequence[Mapping[str, Any]], tensors: Mapping[str, torch.Tensor]) -> list[Outgoing]:
    """The parts a checkpoint holds, per fragment in sequence order (none in one written without them)."""
    parts = []
    for r in records:
        key = f"outgoing/{r['fragment']}/{r['seq']}"
        payload = StoredPayload(tensors[key].numpy().tobytes(), str(r["quantizer"]))
        parts.append(
            Outgoing(
                int(r["fragment"]),
                int(r["base_version"]),
                int(r["steps"]),
                int(r["tokens"]),
                int(r["seq"]),
                payload,
                since=int(r["since"]),
            )
        )
    return sorted(parts, key=lambda c: (c.fragment, c.seq))


def parts_to_resend(parts: Iterable[Outgoing], versions: Mapping[int, int], quantizer: str) -> list[Outgoing]:
    """The parts a resumed learner sends again: those still on its fragment's version (one on an
    older version is superseded: the learner took the newer one at start, as it drops a buffered part
    then) and in the job's quantizer."""
    return [
        c
        for c in parts
        if c.base_version >= versions.get(c.fragment, -1)
        and isinstance(c.tensors, StoredPayload)
        and c.tensors.quantizer == quantizer
    ]
