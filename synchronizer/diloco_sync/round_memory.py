"""The memory the rounds hold between their merge and their commit, bounded together.

From its mathematics to its commit a round holds its fragment's new parameters, outer state and
the new version's encoded payload (the outer state is written to storage as it is encoded, by the
commit): measured, up to about ``ROUND_HOLDS`` times its fragment's float32 size. Rounds
of several fragments run at once while what they hold fits ``--round-memory-bytes`` (small fragments
merge side by side), and one at a time once a fragment is large (the rounds cost one fragment's
memory, not the model's). A round starts whenever no other is in progress, so a fragment larger
than the budget still merges.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

ROUND_HOLDS = 6  # a round's peak in fp32 sizes of its fragment (measured: 5.1, int2 down, 20 M params,
# 1 to 64 contributions: `diloco bench round-memory`)
READ_BACK = 4  # the most a state read back from storage holds: parameters, momentum, buffer, residual


def round_cost(numel: int, read_back: bool = False) -> int:
    """The bytes a round of a fragment of ``numel`` values is counted as holding; ``read_back``: it
    reads the state it starts from back from storage (``held_state``) instead of finding it held."""
    return (ROUND_HOLDS + (READ_BACK if read_back else 0)) * 4 * numel


def may_start(held: int, cost: int, budget: int) -> bool:
    """Whether a round counted at ``cost`` bytes may start while the rounds in progress hold ``held``."""
    return held == 0 or held + cost <= budget


class RoundMemory:
    """The reservations of the rounds in progress against the budget."""

    def __init__(self, budget: int) -> None:
        self.budget, self.held = budget, 0
        self._changed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def reserve(self, cost: int) -> AsyncIterator[None]:
        """Wait until a round counted at ``cost`` bytes may start, and hold them until it ends."""
        async with self._changed:
            await self._changed.wait_for(lambda: may_start(self.held, cost, self.budget))
            self.held += cost
        try:
            yield
        finally:
            async with self._changed:
                self.held -= cost
                self._changed.notify_all()
