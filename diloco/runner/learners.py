"""The learner processes of a run: launching them, failing them, restarting them, and what each did.

Every method takes the time it is about (seconds since the start of the job) and records facts in
the run's record and timeline; the decisions it applies (the failure schedule, who fails together,
goodput) are pure functions elsewhere.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping

from diloco_core.protocol import LearnerStatus

from diloco.failures import Failure
from diloco.runner.commands import CHECKPOINT_EVERY, RunPaths, build_worker_argv, build_worker_env, learner_id
from diloco.runner.learner_metrics import read_counts, read_processes
from diloco.runner.processes import Child, launch
from diloco.runner.record import KillRecord, LearnerTotals, RunRecord
from diloco.runner.settings import RunSettings
from diloco.runner.slots import LearnerSlot, has_rejoined, learner_label, resumed_step
from diloco.runner.timeline import Rollback

MAX_CRASH_RESTARTS = 3


class Learners:
    """The run's learner slots (one per learner, or per rank of the ddp unit) and their processes."""

    def __init__(
        self,
        settings: RunSettings,
        paths: RunPaths,
        record: RunRecord,
        *,
        sync_url: str,
        job_secret: str,
        master_port: int,
        note: Callable[[str], None],
    ) -> None:
        self.s, self.paths, self.record, self.note = settings, paths, record, note
        self.sync_url, self.secret, self.master_port = sync_url, job_secret, master_port
        self.failures = settings.failures
        self.slots = [
            LearnerSlot(i, learner_id(settings, i), settings.speed_of(i), settings.bandwidth_of(i))
            for i in range(settings.learners)
        ]

    def __iter__(self) -> Iterator[LearnerSlot]:
        return iter(self.slots)

    @property
    def ddp(self) -> bool:
        return self.s.mode == "ddp"

    def live_children(self) -> list[Child]:
        return [slot.child for slot in self.slots if slot.child is not None and slot.child.alive()]

    # ---- launching, failing, restarting -----------------------------------------------------------

    def launch(self, slot: LearnerSlot, now: float) -> None:
        argv = build_worker_argv(self.s, self.paths, slot.index, sync_url=self.sync_url)
        env = build_worker_env(
            self.s, slot.index, dict(os.environ), job_secret=self.secret, master_port=self.master_port
        )
        slot.child = launch(f"learner-{slot.index}", argv, self.paths.log_file(f"learner-{slot.index}"), env)
        slot.incarnation += 1
        slot.launched_at_s = now
        slot.launches.append((slot.incarnation, slot.child.pid, now))
        slot.state = "starting" if slot.incarnation == 0 else "rejoining"
        self.record.timeline.enter(slot.index, "starting", now)

    def group_of(self, slot: LearnerSlot) -> list[LearnerSlot]:
        """The processes that fail together: in ddp mode the whole unit (its ranks share every step)."""
        return [self.slots[i] for i in self.failures.group_of(slot.index)]

    def apply_failure(self, failure: Failure, now: float) -> None:
        """A failure instant: kill the learner (its unit, in ddp mode) if it is up, and schedule its
        restart after the repair time; an instant that finds it down or finished is absorbed."""
        slot = self.slots[failure.learner]
        if not slot.up:
            return
        group = self.group_of(slot)
        if any(m.state == "finished" for m in group):
            # the ranks of a unit take every step together: one that finished means the unit's
            # last step is done and the others are only leaving
            self.note(f"[{now:6.1f}s] chaos: {self.who(slot)} not killed, its unit finished training")
            return
        for member in group:
            if member.up and member.child is not None:
                member.child.kill()
                self._mark_down(member, now, by_chaos=member is slot)
                member.down_until_s = now + self.s.repair_s
        self.note(f"[{now:6.1f}s] chaos: killed {self.who(slot)} at step {slot.step}{self._unit_note()}")

    def _mark_down(self, slot: LearnerSlot, now: float, *, by_chaos: bool) -> None:
        slot.step = max(slot.step, self._logged_step(slot))
        if slot.lost_from_step is None:  # killed again while coming back: nothing more was lost
            slot.lost_from_step = slot.step
        slot.state = "down"
        self.record.timeline.enter(slot.index, "down", now)
        if by_chaos:
            if slot.pending_kill is not None:  # killed again while it was still coming back
                slot.pending_kill.killed_again_at_s = now
            slot.pending_kill = KillRecord(slot.index, now, slot.step)
            self.record.kills.append(slot.pending_kill)

    def reap(self, now: float) -> None:
        """Restarts that are due, and processes that exited on their own: finished (code 0) or
        crashed (restarted after the repair time, at most ``MAX_CRASH_RESTARTS`` times)."""
        for slot in self.slots:
            if slot.state == "down":
                if slot.down_until_s is not None and now >= slot.down_until_s:
                    slot.down_until_s = None
                    self.launch(slot, now)
                    if slot.pending_kill is not None:
                        slot.pending_kill.restarted_at_s = now
                        self.note(f"[{now:6.1f}s] chaos: restarted {self.who(slot)}{self._unit_note()}")
                continue
            code = slot.child.exit_code() if slot.child is not None and slot.up else None
            if code is None:
                continue
            if code == 0:
                if slot.pending_kill is not None and slot.pending_kill.restarted_at_s is not None:
                    # restarted after its last step was already checkpointed: back, and done at once
                    slot.pending_kill.rejoined_at_s = now
                    slot.pending_kill = None
                slot.state = "finished"
                self.record.timeline.leave(slot.index, now)
            elif slot.crashes < MAX_CRASH_RESTARTS:
                slot.crashes += 1
                self._mark_down(slot, now, by_chaos=False)
                slot.down_until_s = now + self.s.repair_s
                self.note(f"[{now:6.1f}s] learner {slot.index} exited with code {code}; restarting")
            else:
                slot.state = "failed"
                self.record.timeline.leave(slot.index, now)
                log_path = slot.child.log_path if slot.child else ""
                self.note(
                    f"[{now:6.1f}s] learner {slot.index} failed {slot.crashes + 1} times; see {log_path}"
                )

    # ---- what the synchronizer says ---------------------------------------------------------------

    def update(self, statuses: Mapping[str, LearnerStatus], now: float) -> None:
        """Take the synchronizer's view of each learner (by id): rejoins, steps, speed, blocked time."""
        for slot in self.slots:
            ls = statuses.get(slot.learner_id)
            if ls is None:
                continue
            if slot.state in ("starting", "rejoining") and has_rejoined(slot, ls, now):
                self._on_rejoined(slot, ls.step, now)
            if slot.state in ("training", "finished"):
                slot.step = max(slot.step, ls.step) if slot.incarnation == 0 else ls.step
                per_step = self.s.tokens_per_step_of(slot.index)
                slot.tokens = slot.step * per_step
                slot.step_time_s = ls.step_time_s
                slot.tokens_per_s = per_step / ls.step_time_s if ls.step_time_s > 0 else 0.0
                slot.staleness = ls.staleness
                # in ddp mode the status is rank 0's, and every rank of the unit spends the same time at
                # each step boundary (the others wait for rank 0's broadcast): each rank's time counts
                self.record.timeline.record_blocked(slot.index, slot.incarnation, ls.blocked_s)

    def _on_rejoined(self, slot: LearnerSlot, step: int, now: float) -> None:
        slot.state = "training"
        self.record.timeline.enter(slot.index, "training", now)
        if slot.lost_from_step is not None:
            # the step it resumed from (its log says), not the one it already reached again by now
            start = resumed_step(slot.child.log_tail(200_000)) if slot.child is not None else None
            resumed = min(step, start) if start is not None else step
            rollback = Rollback(slot.index, now, slot.lost_from_step, resumed, slot.step_time_s)
            self.record.timeline.rollbacks.append(rollback)
            slot.lost_from_step = None
            kill = slot.pending_kill
            if kill is not None:
                kill.rejoined_at_s = now
                slot.pending_kill = None
                self.note(
                    f"[{now:6.1f}s] {self.who(slot)} rejoined at step {step} (killed at step {kill.step}, "
                    f"resumed from step {resumed})"
                )
        slot.step = step

    # ---- the end ----------------------------------------------------------------------------------

    def count_unrecovered_losses(self, now: float) -> None:
        """Work lost by learners that were killed and had not trained again when the run ended: they
        would resume from their newest checkpoint, every ``CHECKPOINT_EVERY`` steps (or from what
        their new process's log says it resumed from)."""
        for slot in self.slots:
            if slot.lost_from_step is None:
                continue
            relaunched = slot.state in ("starting", "rejoining") and slot.child is not None
            logged = resumed_step(slot.child.log_tail(200_000)) if relaunched and slot.child else None
            resumed = logged if logged else slot.lost_from_step - slot.lost_from_step % CHECKPOINT_EVERY
            rollback = Rollback(slot.index, now, slot.lost_from_step, resumed, slot.step_time_s)
            self.record.timeline.rollbacks.append(rollback)
            slot.lost_from_step = None

    def take_own_reports(self, t0_wall: float) -> None:
        """Replace what the status polls saw with what each process reported in its metrics file (in
        ddp mode rank 0's, for every rank of the unit, which trains in step): its training starts
        at the end of its first step, and its blocked time is what it added to the counter it
        resumed with (a status poll right after a restart can still show the previous process's
        counter). Call after the timeline is closed."""
        writers = [self.slots[0]] if self.ddp else self.slots
        facts = {}
        for writer in writers:
            by_pid = read_processes(self.paths.metrics_file(writer.index))
            for incarnation, pid, _ in writer.launches:
                if pid in by_pid:
                    facts[(writer.index, incarnation)] = by_pid[pid]
        timeline = self.record.timeline
        for slot in self.slots:
            for incarnation, _, launched_at in slot.launches:
                fact = facts.get((0 if self.ddp else slot.index, incarnation))
                if fact is not None:
                    timeline.move_training_start(slot.index, launched_at, fact.first_step_at - t0_wall)
                    timeline.blocked_s[(slot.index, incarnation)] = fact.blocked_s

    def totals(self) -> list[LearnerTotals]:
        return [self._totals(slot) for slot in self.slots]

    def _totals(self, slot: LearnerSlot) -> LearnerTotals:
        """A learner's final counts from its metrics file (exact), else from the last status poll.

        In ddp mode rank 0 writes the unit's file: every rank took the unit's steps, and the unit's
        tokens and bytes are shared out so that the totals add up to the unit's."""
        steps, tokens, sent, reduced = slot.step, slot.tokens, 0, 0
        tokens_per_s: float | None = None
        mfu: float | None = None
        writer = self.slots[0] if self.ddp else slot
        own = {pid for _, pid, _ in writer.launches} if self.record.resumed else None
        counts = read_counts(self.paths.metrics_file(writer.index), pids=own)
        if counts is not None:
            steps, tokens = counts.step, counts.tokens
            if self.record.resumed:  # this run's part: from the step before its first one
                before = counts.first_step - 1
                self.record.resumed_from[slot.learner_id] = before
                steps -= before
                tokens -= counts.first_tokens * before // max(1, counts.first_step)
            tokens = tokens // self.s.learners if self.ddp else tokens
            sent = counts.bytes_sent if not self.ddp or slot.index == 0 else 0
            reduced = counts.allreduce_bytes if self.ddp else 0  # every rank sends (and receives) rank 0's
            # a ddp unit's rate is its ranks' together: each rank's share; its MFU is each rank's
            tokens_per_s = (
                counts.tokens_per_s / self.s.learners
                if self.ddp and counts.tokens_per_s
                else counts.tokens_per_s
            )
            mfu = counts.mfu
        return LearnerTotals(
            learner=slot.index,
            learner_id=slot.learner_id,
            speed_factor=slot.speed_factor,
            bandwidth_limit=slot.bandwidth_limit,
            steps=steps,
            tokens=tokens,
            launches=slot.incarnation + 1,
            finished=slot.state == "finished",
            bytes_sent=sent,
            allreduce_bytes=reduced,
            tokens_per_s=tokens_per_s,
            mfu=mfu,
            gpu=self.s.gpu_of(slot.index),
        )

    # ---- naming -----------------------------------------------------------------------------------

    def _logged_step(self, slot: LearnerSlot) -> int:
        """The newest step the learner's current process wrote to its metrics file: fresher than the
        last heartbeat. In ddp mode rank 0's process writes the unit's file."""
        writer = self.slots[0] if self.ddp else slot
        if writer.child is None:
            return 0
        counts = read_counts(self.paths.metrics_file(writer.index), pids={writer.child.pid})
        return counts.step if counts is not None else 0

    def who(self, slot: LearnerSlot) -> str:
        return learner_label(self.s.mode, slot.index, slot.learner_id)

    def _unit_note(self) -> str:
        return f" (the unit's {self.s.learners} ranks fail and restart together)" if self.ddp else ""
