"""Per learner, the parts of its progress a fragment holds outside a merge: the pending one (its
earliest) and those that wait behind a gap after it, in step order. Parts are added up only where
they meet (``contribution.fold``); a part is superseded by one that covers its steps or is on
another base. Mutated only by its fragment's state machine (``fragment_state``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from .contribution import Contribution, fold, relation


class LearnerParts:
    def __init__(self) -> None:
        self.pending: dict[str, Contribution] = {}  # by learner: its earliest part not being merged
        self._waiting: dict[str, list[Contribution]] = {}  # by learner: its later parts, each after a gap

    def waiting(self) -> dict[str, tuple[Contribution, ...]]:
        return {name: tuple(parts) for name, parts in self._waiting.items()}

    def waiting_of(self, learner_id: str) -> list[Contribution]:
        return self._waiting.get(learner_id, [])

    def all(self) -> Iterator[Contribution]:
        """The pending parts, then those waiting."""
        yield from self.pending.values()
        yield from (c for parts in self._waiting.values() for c in parts)

    def place(self, c: Contribution) -> tuple[Contribution | None, list[Contribution]]:
        """Take ``c``: the learner's pending part after it (None: ``c`` waits behind a gap after the
        pending one), and the parts it superseded."""
        learner = c.learner_id
        previous = self.pending.get(learner)
        superseded: list[Contribution] = []
        if previous is not None and previous.base_version == c.base_version:
            where = relation(previous, c.since, c.through)
            if where == "after" and c.since != previous.through:
                self._wait(c)
                return None, []
            if where == "after":
                c = fold(previous, c)
            elif where == "before" and c.through == previous.since:
                c = fold(c, previous)
            elif where == "before":
                self._wait(previous)  # the pending part waits behind the gap before it
            else:
                superseded.append(previous)
        elif previous is not None:  # another base supersedes the parts on the other bases
            waiting = self._waiting.pop(learner, [])
            superseded += [previous, *(w for w in waiting if w.base_version != c.base_version)]
            if kept := [w for w in waiting if w.base_version == c.base_version]:
                self._waiting[learner] = kept
        self.pending[learner] = c = self._continued(c)
        return c, superseded

    def take(self, learner_id: str) -> Contribution | None:
        """Take the learner's pending part out; its first waiting part, if any, takes its place."""
        taken = self.pending.pop(learner_id, None)
        parts = self._waiting.get(learner_id)
        if parts:
            self.pending[learner_id] = self._continued(parts.pop(0))
        return taken

    def drop(
        self, stale: Callable[[Contribution], bool], ready: Callable[[Contribution], bool]
    ) -> list[Contribution]:
        """Drop the parts with a gap before them (waiting, or pending and not ``ready``) that are
        ``stale``; returns them."""
        dropped: list[Contribution] = []
        for name in list(self._waiting):
            dropped += [c for c in self._waiting[name] if stale(c)]
            self._waiting[name] = [c for c in self._waiting[name] if not stale(c)]
            if not self._waiting[name]:
                del self._waiting[name]
        for name in [name for name, c in self.pending.items() if not ready(c) and stale(c)]:
            dropped += [c for c in (self.take(name),) if c is not None]
        return dropped

    def _wait(self, c: Contribution) -> None:
        """Hold a part with a gap before it, in step order, folded with the waiting parts it meets."""
        parts = sorted([*self._waiting.get(c.learner_id, ()), c], key=lambda x: (x.base_version, x.since))
        joined: list[Contribution] = []
        for part in parts:
            last = joined[-1] if joined else None
            if last is not None and last.base_version == part.base_version and last.through == part.since:
                joined[-1] = fold(last, part)
            else:
                joined.append(part)
        self._waiting[c.learner_id] = joined

    def _continued(self, c: Contribution) -> Contribution:
        """``c`` with the learner's waiting parts that now follow it without a gap folded in."""
        parts = self._waiting.get(c.learner_id, [])
        while parts and parts[0].base_version == c.base_version and parts[0].since == c.through:
            c = fold(c, parts.pop(0))
        if not parts:
            self._waiting.pop(c.learner_id, None)
        return c
