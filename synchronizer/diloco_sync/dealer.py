"""The job's training data dealt to its units (``diloco_core.dealing``), on shard 0: the record is
loaded from storage at the first request and stored before an answer deals anything new, so an answer
once given is given again after any restart."""

from __future__ import annotations

import asyncio

from diloco_core.dealing import DealError, DealRecord, DealtRange, deal
from diloco_core.storage import StorageError

from .errors import ApiError
from .persistence import StateStore
from .storage_guard import StorageGuard

DEALER_SHARD = 0


class Dealer:
    def __init__(self, store: StateStore, guard: StorageGuard, shard_index: int) -> None:
        self.store, self.guard, self.shard_index = store, guard, shard_index
        self._record: DealRecord | None = None
        self._lock = asyncio.Lock()

    async def range(self, unit: str, position: int, size: int) -> DealtRange:
        """The unit's range that holds ``position`` of its sequence (``diloco_core.dealing.deal``);
        ApiError 409 ``deal_refused`` or 503 ``storage_unavailable`` (nothing dealt)."""
        if self.shard_index != DEALER_SHARD:
            raise ApiError(
                409, "deal_refused", f"the job's data is dealt by synchronizer shard {DEALER_SHARD}"
            )
        async with self._lock:
            try:
                if self._record is None:
                    self._record = await self.guard.call(self.store.load_deal)
                record, dealt = deal(self._record, unit, position, size)
                if record is not self._record:
                    await self.guard.call(self.store.save_deal, record)
                    self._record = record
            except DealError as exc:
                raise ApiError(409, "deal_refused", str(exc)) from None
            except StorageError as exc:
                raise ApiError(
                    503, "storage_unavailable", f"cannot store the data deal: {exc}", retryable=True
                ) from exc
        return dealt
