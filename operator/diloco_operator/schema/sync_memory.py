"""What a job's synchronizer may hold in memory for each of its uses (``spec.synchronizer.memory``).

Four budgets of the synchronizer (``diloco_sync.settings``) follow the model's size rather than a
fixed default, so a job sets them with its synchronizer's memory:

- ``rounds``: the rounds between their merge and their commit together (``--round-memory-bytes``);
- ``servedInMemory``: the largest fragment version held in memory between rounds; a larger one is
  served from, and its next round reads its state back from, storage (``--served-in-memory-bytes``);
- ``outageBuffer``: the contributions held while storage is down (``--memory-budget-bytes``);
- ``pending``: the contributions waiting for or in their rounds, with the bodies being received
  (``--pending-memory-bytes``; beyond it a learner's further part waits for a round to free room).

Each is a Kubernetes quantity (``4Gi``, ``512Mi``). One left unset takes the synchronizer's own
default, or, when ``synchronizer.resources.limits.memory`` is set, a share of that limit
(:func:`budgets`): of what the limit leaves above ``BASE_BYTES`` (Python, the web server, the payloads
being decoded: an idle synchronizer holds about 70 MB), a third for the rounds, a third for the outage
buffer, an eighth, at most 64 Mi, for a served version, and what the others leave for the pending
contributions. Together they must fit in the limit, or the spec is refused: a budget larger than the pod may use would end in the kernel killing it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from diloco_operator.schema.quantity import quantity_bytes

# the synchronizer's default for the largest version it serves from memory (its --served-in-memory-bytes;
# the operator does not import the synchronizer, a test checks the two agree), the most a limit's share gives
SERVED_IN_MEMORY_CAP = 64 * 1024**2
# the share of the room above BASE_BYTES in the memory limit that an unset budget takes (1/n)
ROUNDS_SHARE, OUTAGE_SHARE, SERVED_SHARE = 3, 3, 8
# what every synchronizer needs besides these budgets: Python, the web server, the codec's buffers
BASE_BYTES = 256 * 1024**2


class SynchronizerMemory(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)

    rounds: int | str | None = Field(None, description="the rounds between merge and commit, together")
    served_in_memory: int | str | None = Field(None, description="the largest version held in memory")
    outage_buffer: int | str | None = Field(None, description="contributions held while storage is down")
    pending: int | str | None = Field(None, description="contributions waiting for or in their rounds")

    def given(self) -> dict[str, int]:
        """The budgets the spec sets, in bytes (a bad quantity raises ``ValueError`` naming it)."""
        out = {}
        for name in ("rounds", "served_in_memory", "outage_buffer", "pending"):
            value = getattr(self, name)
            if value is not None:
                try:
                    out[name] = quantity_bytes(value)
                except ValueError as exc:
                    raise ValueError(f"synchronizer.memory.{to_camel(name)}: {exc}") from None
        return out


@dataclass(frozen=True)
class Budgets:
    """The synchronizer's four memory budgets, in bytes (None: the synchronizer's own default)."""

    rounds: int | None = None
    served_in_memory: int | None = None
    outage_buffer: int | None = None
    pending: int | None = None

    def settings(self) -> dict[str, int]:
        """The budgets set, by the synchronizer's setting that takes each (``diloco_sync.settings``:
        ``--round-memory-bytes``, ``DILOCO_ROUND_MEMORY_BYTES``, ...); the others keep its defaults."""
        named = (("round_memory_bytes", self.rounds), ("served_in_memory_bytes", self.served_in_memory),
                 ("memory_budget_bytes", self.outage_buffer), ("pending_memory_bytes", self.pending))  # fmt: skip
        return {name: size for name, size in named if size is not None}


def budgets(memory: SynchronizerMemory | None, limit: int | None) -> Budgets:
    """Each budget as the spec sets it, else a share of what the memory ``limit`` leaves above
    ``BASE_BYTES`` (the pending contributions: what the others leave), else None (the synchronizer's
    default). ``ValueError`` when, with a limit, they do not fit in it."""
    given = memory.given() if memory is not None else {}
    if limit is None:
        return Budgets(**given)
    room = limit - BASE_BYTES
    if room <= 0:
        raise ValueError(
            f"synchronizer.resources.limits.memory ({limit:,} B) is not above the {BASE_BYTES // 1024**2} Mi "
            "that a synchronizer needs besides its budgets (Python, its web server, the payloads being "
            "decoded): raise the limit"
        )
    shares = {"rounds": room // ROUNDS_SHARE, "served_in_memory": min(SERVED_IN_MEMORY_CAP, room // SERVED_SHARE),
              "outage_buffer": room // OUTAGE_SHARE}  # fmt: skip
    sizes = shares | given
    sizes.setdefault("pending", max(0, room - sum(sizes.values())))
    if sum(sizes.values()) > room:
        raise ValueError(
            f"synchronizer.memory: rounds ({sizes['rounds']:,} B) + servedInMemory "
            f"({sizes['served_in_memory']:,} B) + outageBuffer ({sizes['outage_buffer']:,} B) + pending "
            f"({sizes['pending']:,} B) do not fit in synchronizer.resources.limits.memory ({limit:,} B) "
            f"with the {BASE_BYTES // 1024**2} Mi a synchronizer needs besides: lower them or raise the limit"
        )
    return Budgets(**sizes)
