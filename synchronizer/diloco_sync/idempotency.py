"""The idempotency keys a fragment knows: those being checked and written now (reserved), and those of
contributions merged or superseded (applied), so that a resend of any of them is a duplicate."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from .contribution import Contribution

APPLIED_KEYS = 4096  # idempotency keys of merged (or superseded) contributions remembered


class IdempotencyKeys:
    def __init__(self) -> None:
        self._applied: deque[str] = deque(maxlen=APPLIED_KEYS)
        self._reserved: set[str] = set()  # keys being validated/persisted right now

    @property
    def applied(self) -> tuple[str, ...]:
        """Keys of contributions merged or superseded, oldest first."""
        return tuple(self._applied)

    def apply(self, keys: Iterable[str]) -> None:
        self._applied.extend(keys)

    def apply_all(self, contributions: Iterable[Contribution]) -> None:
        """Every key of these contributions (each part as received) is applied."""
        self._applied.extend(part.key for c in contributions for part in c.received())

    def is_known(self, key: str, held: Iterable[Contribution]) -> bool:
        """True when the key is reserved, applied, or that of a part of a contribution ``held``."""
        return (
            key in self._reserved
            or key in self._applied
            or any(part.key == key for c in held for part in c.received())
        )

    def is_durable(self, key: str, held: Iterable[Contribution]) -> bool:
        """True when the key is applied or a part ``held`` with it is written to storage."""
        if key in self._applied:
            return True
        for c in held:
            for part in c.received():
                if part.key == key:
                    return part.storage_key is not None
        return False

    def reserve(self, key: str, held: Iterable[Contribution]) -> bool:
        """Hold a key while its contribution is checked and written; False when it is known already."""
        if self.is_known(key, held):
            return False
        self._reserved.add(key)
        return True

    def release(self, key: str) -> None:
        self._reserved.discard(key)
