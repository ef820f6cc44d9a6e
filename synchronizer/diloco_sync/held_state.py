"""Where a fragment's parameters and outer state wait between its rounds.

In memory while its version is served from memory; for a version larger than
``--served-in-memory-bytes`` (served from its committed object, ``publication.Stored``) they are let
go once the round is committed and read back from the committed objects when the fragment's next
round starts, so that between rounds the synchronizer holds no copy of a large fragment. The objects
are the ones a restart reads (``recovery``), and the version's manifest names them, so the state a
round reads is bit for bit the state it would have held.
"""

from __future__ import annotations

from dataclasses import dataclass

from diloco_core import codec
from diloco_core.fragments import Fragment
from diloco_core.outer import OuterState

from .contribution import Arrays
from .persistence import StateStore
from .publication import Served, Stored


@dataclass(frozen=True)
class InStorage:
    """A fragment's state held in its committed objects (``outer_key`` None: a fresh outer state)."""

    params_key: str
    outer_key: str | None


def kept_in_storage(payload: Served, outer_key: str | None) -> InStorage | None:
    """Where the state of a version served as ``payload`` waits: in its objects when the version is
    served from storage, else (None) in memory."""
    return InStorage(payload.key, outer_key) if isinstance(payload, Stored) else None


def read_committed(
    store: StateStore, spec: Fragment, params_key: str, outer_key: str | None
) -> tuple[Arrays, memoryview, Arrays | None]:
    """A committed version's parameters, their payload, and its outer state's arrays (None when it
    has none) (blocking)."""
    payload = store.read(params_key)
    params = codec.decode(payload, fragment=spec).tensors
    outer = None
    if outer_key:  # momentum, and the delayed buffer and download residual where used
        bound = max(codec.DEFAULT_MAX_BYTES, 3 * codec.max_payload_size(spec))
        outer = codec.decode(store.read(outer_key), max_bytes=bound).tensors
    return params, payload, outer


def read_state(store: StateStore, spec: Fragment, at: InStorage) -> tuple[Arrays, OuterState]:
    """What a round starts from, read back from the objects that hold it (blocking)."""
    params, _, outer = read_committed(store, spec, at.params_key, at.outer_key)
    return params, OuterState.from_arrays(outer, given=True) if outer is not None else OuterState()


class HeldState:
    """A fragment's parameters and outer state between its rounds: in memory, or in storage."""

    def __init__(self) -> None:
        self.params: Arrays | None = None  # None: before the initial parameters, or in storage
        self._outer: OuterState | None = OuterState()
        self.in_storage: InStorage | None = None

    @property
    def outer(self) -> OuterState:
        """The outer state after the current version, while it is held in memory."""
        if self._outer is None:
            raise RuntimeError("the outer state is in storage: a round reads it back (for_round)")
        return self._outer

    def hold(self, params: Arrays | None, outer: OuterState, payload: Served, outer_key: str | None) -> None:
        """The state of the version served as ``payload``, its outer state's object ``outer_key``
        (``params`` None only for a version served from storage, whose state waits there)."""
        self.in_storage = kept_in_storage(payload, outer_key)
        if self.in_storage is None and params is None:
            raise ValueError("a version served from memory needs its parameters")
        self.params, self._outer = (None, None) if self.in_storage is not None else (params, outer)

    def for_round(self) -> tuple[Arrays, OuterState] | InStorage:
        """What the next round starts from: the arrays, or the objects it reads them back from."""
        if self.in_storage is not None:
            return self.in_storage
        if self.params is None:
            raise RuntimeError("no parameters yet")
        return self.params, self.outer
