"""Where the synchronizer keeps a job's state in the object store, and the small records it writes
(read back by the synchronizer on restart, and by ``diloco export`` through :mod:`.global_model`).

Layout under ``shard-<i>/`` (one folder per shard, so replicas never write each other's objects):

- ``plan.json``                              the adopted fragment plan (written once)
- ``learners.json``                          the learner registry
- ``fragments/<p>/params-<v>.bin``           global parameters of fragment p at version v (codec, fp32-planes; fp32 from earlier builds)
- ``fragments/<p>/outer-<v>.bin``            outer-optimizer state after version v (codec, fp32, stored)
- ``rounds/<p>/<v>.json``                    the round log: who was merged into version v, with weights
- ``pending/<p>/<learner>/<base>-<seq>.bin`` a contribution accepted but not merged yet
- ``manifest.json``                          written last: the committed version of every fragment

A reader trusts only what the manifest points at; objects written before a crash but never named by
a manifest are ignored and collected later. Pending contributions are framed as
``b"DLCP" + u32 length + JSON metadata + codec payload`` (no pickle). One written as its payload
arrives keeps ``PENDING_HEAD_ROOM`` bytes for the metadata, filled in once the payload is checked and
padded with spaces (which JSON ignores), so it reads as any other.
"""

from __future__ import annotations

import json
import struct

from pydantic import BaseModel, ConfigDict, Field

from diloco_core.screening import NormHistory

MANIFEST_FORMAT = 1
_PENDING_MAGIC = b"DLCP"
PENDING_HEAD_ROOM = 1024  # the longest metadata (a 128-character learner id, 20-digit numbers) is under 512
PENDING_HEAD_SIZE = 8 + PENDING_HEAD_ROOM  # the magic, the length and the room


class LayoutError(ValueError):
    """A stored object does not have the expected shape."""


class FragmentRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int
    params_key: str
    outer_key: str | None = None
    params_bytes: int | None = Field(
        None, ge=0, description="the params object's size (None: a manifest from before it was recorded)"
    )
    rounds: int = 0
    applied: list[str] = Field(
        default_factory=list, description="idempotency keys merged recently, oldest first"
    )
    merged_through: dict[str, tuple[int, int]] = Field(
        default_factory=dict,
        description="per learner: the base version of its newest merged contribution and the step it reaches",
    )
    contribution_norms: list[float] = Field(
        default_factory=list, description="norms of the recently merged contributions, oldest first"
    )
    update_norms: list[float] = Field(default_factory=list, description="norms of the recent rounds' updates")
    reference_norm: float = Field(0.0, ge=0.0, description="the parameters' norm at the first checked round")
    version_times: dict[int, float] = Field(
        default_factory=dict, description="when the recent versions were committed (unix seconds)"
    )

    def norm_history(self) -> NormHistory:
        """The round checks' history as committed (``diloco_core.screening``)."""
        return NormHistory(tuple(self.contribution_norms), tuple(self.update_norms), self.reference_norm)


class Manifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: int = MANIFEST_FORMAT
    job_id: str
    shard: int
    plan_hash: str
    fragments: dict[int, FragmentRecord] = Field(default_factory=dict)
    rounds: int = 0


class LearnerRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    learner_id: str
    unit: str = ""
    tokens_per_step: int = 1
    registered_at: float = 0.0
    left: bool = False  # left cleanly: not counted alive after a restart of the synchronizer
    # the step and token total the learner reported when it left: a restarted synchronizer still
    # knows how far a finished learner got (the job's step budget and token count depend on it)
    step: int = 0
    tokens: int = 0


class LearnerRegistryRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    learners: dict[str, LearnerRecord] = Field(default_factory=dict)


class PendingMeta(BaseModel):
    model_config = ConfigDict(extra="forbid")

    learner_id: str
    fragment: int
    base_version: int
    seq: int
    steps: int
    tokens: int
    received_at: float
    since: int = 0  # the learner's progress on the base before this contribution (in steps)


class Layout:
    """Key names of one shard's objects."""

    def __init__(self, shard: int) -> None:
        self.root = f"shard-{shard:03d}"

    @property
    def manifest(self) -> str:
        return f"{self.root}/manifest.json"

    @property
    def plan(self) -> str:
        return f"{self.root}/plan.json"

    @property
    def learners(self) -> str:
        return f"{self.root}/learners.json"

    @property
    def deal(self) -> str:
        """What the job's training data dealt to its units (``diloco_core.dealing``)."""
        return f"{self.root}/deal.json"

    def fragment_prefix(self, fragment: int) -> str:
        return f"{self.root}/fragments/{fragment}/"

    def params(self, fragment: int, version: int) -> str:
        return f"{self.fragment_prefix(fragment)}params-{version:010d}.bin"

    def outer(self, fragment: int, version: int) -> str:
        return f"{self.fragment_prefix(fragment)}outer-{version:010d}.bin"

    def round_log(self, fragment: int, version: int) -> str:
        return f"{self.root}/rounds/{fragment}/{version:010d}.json"

    @property
    def pending_prefix(self) -> str:
        return f"{self.root}/pending/"

    def pending(self, fragment: int, learner_id: str, base_version: int, seq: int) -> str:
        return f"{self.pending_prefix}{fragment}/{learner_id}/{base_version}-{seq}.bin"


def version_of_key(key: str) -> int | None:
    """The version number in a ``params-<v>.bin`` / ``outer-<v>.bin`` key, or None."""
    name = key.rsplit("/", 1)[-1]
    stem, _, ext = name.partition(".")
    kind, _, digits = stem.partition("-")
    if ext != "bin" or kind not in ("params", "outer") or not digits.isdigit():
        return None
    return int(digits)


def contribution_key(learner_id: str, fragment: int, base_version: int, seq: int) -> str:
    """The idempotency key of a contribution (a learner id holds no ``/``)."""
    return f"{learner_id}/{fragment}/{base_version}/{seq}"


def key_base_version(key: str) -> int:
    """The base version a ``contribution_key`` names."""
    return int(key.split("/")[2])


def pack_pending(meta: PendingMeta, payload: bytes) -> bytes:
    head = meta.model_dump_json().encode()
    return _PENDING_MAGIC + struct.pack("<I", len(head)) + head + payload


def pending_head(meta: PendingMeta | None, room: int = PENDING_HEAD_ROOM) -> bytes:
    """The head of a pending object whose metadata takes ``room`` bytes: ``meta`` padded with
    spaces, or with None the placeholder written before the payload (unreadable until filled in)."""
    head = b"" if meta is None else meta.model_dump_json().encode()
    if len(head) > room:
        raise LayoutError(f"pending contribution metadata of {len(head)} bytes exceeds its {room}")
    return _PENDING_MAGIC + struct.pack("<I", room) + head + b" " * (room - len(head))


def unpack_pending(blob: bytes) -> tuple[PendingMeta, bytes]:
    if len(blob) < 8 or blob[:4] != _PENDING_MAGIC:
        raise LayoutError("not a pending contribution object")
    (size,) = struct.unpack("<I", blob[4:8])
    if 8 + size > len(blob):
        raise LayoutError("pending contribution object is truncated")
    try:
        meta = PendingMeta.model_validate(json.loads(blob[8 : 8 + size]))
    except ValueError as exc:
        raise LayoutError(f"pending contribution metadata: {exc}") from exc
    return meta, blob[8 + size :]
