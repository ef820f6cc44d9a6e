"""The run: one synchronizer, N learner processes, chaos, progress and the record of what happened.

All decisions (the chaos schedule, goodput, the report) are pure functions elsewhere; this module
does the process and HTTP I/O and feeds them facts with times measured from the start of the job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from types import FrameType

import httpx
from diloco_core.protocol import StatusResponse

from diloco.failures import Failure
from diloco.runner.chaos import build_chaos_schedule, due_events
from diloco.runner.commands import (
    RunPaths,
    build_synchronizer_argv,
    build_synchronizer_env,
    build_worker_argv,
    build_worker_env,
    learner_id,
)
from diloco.runner.evaluation import GlobalEvaluator
from diloco.runner.learner_metrics import read_counts
from diloco.runner.processes import Child, free_port, launch, stop_all
from diloco.runner.record import KillRecord, LearnerTotals, LossSample, RunRecord
from diloco.runner.settings import RunSettings
from diloco.runner.slots import LearnerSlot, has_rejoined, learner_label, resumed_step
from diloco.runner.timeline import Rollback
from diloco.runner.view import LearnerRow, ProgressView, Snapshot

log = logging.getLogger(__name__)

MAX_CRASH_RESTARTS = 3
EVAL_INTERVAL_S = 3.0


class RunError(RuntimeError):
    """The run could not start (the message says why and where the logs are)."""


class Orchestrator:
    def __init__(
        self, settings: RunSettings, paths: RunPaths, view: ProgressView, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.s, self.paths, self.view, self.clock = settings, paths, view, clock
        self.secret = secrets.token_hex(16)
        self.port = settings.port or free_port(settings.host)
        self.master_port = free_port(settings.host)
        self.sync_url = f"http://{settings.host}:{self.port}"
        self.slots = [
            LearnerSlot(i, learner_id(settings, i), settings.speed_of(i), settings.bandwidth_of(i))
            for i in range(settings.learners)
        ]
        self.record = RunRecord(
            run_dir=str(paths.root), mode=settings.mode, settings=_settings_dict(settings), started_at=time.time(),
            tokens_per_step=settings.tokens_per_step,
        )
        self.failures = settings.failures
        self.schedule: tuple[Failure, ...] = build_chaos_schedule(settings)
        self.sync: Child | None = None
        self.evaluator: GlobalEvaluator | None = None
        self.http = httpx.Client(base_url=self.sync_url, timeout=5.0)
        self.t0 = clock()
        self.stop_requested = False
        self.status: StatusResponse | None = None
        self._last_eval_s = -1e9
        self._last_versions: dict[int, int] = {}
        self._notes: list[str] = []

    def now(self) -> float:
        return self.clock() - self.t0

    # ---- life cycle -------------------------------------------------------------------------------

    def run(self) -> RunRecord:
        """Start the job, run it until a stop reason, shut it down; the record says what happened.

        A Ctrl-C (or SIGTERM) is looked at after every start-up phase: one that arrives before the
        learners are all launched skips the rest of the start-up and goes straight to the shutdown."""
        with self.catching_signals():
            try:
                phase = self._start_up()
                self.record.stop_reason = (
                    self._loop() if phase is None else f"interrupted (Ctrl-C) during start-up, {phase}"
                )
            finally:
                self._shutdown()
        return self.record

    @contextlib.contextmanager
    def catching_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM set ``stop_requested`` instead of raising (nests: the outermost restores
        the previous handlers)."""
        previous = signal.signal(signal.SIGINT, self._on_sigint)
        previous_term = signal.signal(signal.SIGTERM, self._on_sigint)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)
            signal.signal(signal.SIGTERM, previous_term)

    def _start_up(self) -> str | None:
        """Synchronizer, evaluator, learners; None when all started, else the phase a stop request
        interrupted."""
        if self.stop_requested:
            return "before the synchronizer was started"
        self._start_synchronizer()
        if self.stop_requested:
            return "while waiting for the synchronizer"
        self._evaluator()  # loads PyTorch and the held-out data before the clock starts
        if self.stop_requested:
            return "while loading the evaluator"
        self.t0 = self.clock()
        for slot in self.slots:
            if self.stop_requested:
                return f"after launching {slot.index} of {len(self.slots)} learners"
            self._launch(slot)
        return None

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.stop_requested = True

    def _start_synchronizer(self) -> None:
        """Launch the synchronizer and wait until it answers (or a stop request ends the wait)."""
        argv = build_synchronizer_argv(self.s, self.paths, port=self.port)
        env = build_synchronizer_env(_child_env(), job_secret=self.secret)
        self.sync = launch("synchronizer", argv, self.paths.log_file("synchronizer"), env)
        deadline = self.clock() + 60.0
        while self.clock() < deadline:
            if self.stop_requested:
                return
            if not self.sync.alive():
                raise RunError(
                    f"the synchronizer exited with code {self.sync.exit_code()}; its log "
                    f"{self.sync.log_path}:\n{self.sync.log_tail()}"
                )
            if self._fetch_status() is not None:
                return
            time.sleep(0.2)
        raise RunError(f"the synchronizer did not answer on {self.sync_url} within 60 s; see {self.sync.log_path}")

    def _launch(self, slot: LearnerSlot) -> None:
        argv = build_worker_argv(self.s, self.paths, slot.index, sync_url=self.sync_url)
        env = build_worker_env(self.s, slot.index, _child_env(), job_secret=self.secret, master_port=self.master_port)
        slot.child = launch(f"learner-{slot.index}", argv, self.paths.log_file(f"learner-{slot.index}"), env)
        slot.incarnation += 1
        slot.launched_at_s = self.now()
        slot.state = "starting" if slot.incarnation == 0 else "rejoining"
        self.record.timeline.enter(slot.index, "starting", slot.launched_at_s)

    def _shutdown(self) -> None:
        now = self.now()
        children = [slot.child for slot in self.slots if slot.child is not None and slot.child.alive()]
        stop_all(children, self.s.stop_timeout_s)
        self._poll()  # the learners' last heartbeats and bytes
        self.record.timeline.close(now)
        self._final_evaluation()
        if self.sync is not None:
            stop_all([self.sync], self.s.stop_timeout_s)
        self.http.close()
        if self.evaluator is not None:
            self.evaluator.close()
        self.record.duration_s = now
        self.record.learners = [self._totals(slot) for slot in self.slots]

    def _totals(self, slot: LearnerSlot) -> LearnerTotals:
        """A learner's final counts from its metrics file (exact), else from the last status poll.

        In ddp mode rank 0 writes the unit's file: every rank took the unit's steps, and the unit's
        tokens and bytes are shared out so that the totals add up to the unit's."""
        steps, tokens, sent = slot.step, slot.tokens, 0
        tokens_per_s: float | None = None
        mfu: float | None = None
        ddp = self.s.mode == "ddp"
        counts = read_counts(self.paths.metrics_file(0 if ddp else slot.index))
        if counts is not None:
            steps = counts.step
            tokens = counts.tokens // self.s.learners if ddp else counts.tokens
            sent = counts.bytes_sent if not ddp or slot.index == 0 else 0
            # a ddp unit's rate is its ranks' together: each rank's share; its MFU is each rank's
            tokens_per_s = counts.tokens_per_s / self.s.learners if ddp and counts.tokens_per_s else counts.tokens_per_s
            mfu = counts.mfu
        return LearnerTotals(
            learner=slot.index, learner_id=slot.learner_id, speed_factor=slot.speed_factor,
            bandwidth_limit=slot.bandwidth_limit, steps=steps, tokens=tokens,
            launches=slot.incarnation + 1, finished=slot.state == "finished", bytes_sent=sent,
            tokens_per_s=tokens_per_s, mfu=mfu, gpu=self.s.gpu_of(slot.index),
        )

    # ---- the loop ---------------------------------------------------------------------------------

    def _loop(self) -> str:
        cursor = 0
        while True:
            now = self.now()
            if self.stop_requested:
                return "interrupted (Ctrl-C)"
            if self.sync is not None and not self.sync.alive():
                return f"the synchronizer exited with code {self.sync.exit_code()}"
            failures, cursor = due_events(self.schedule, cursor, now)
            for failure in failures:
                self._apply_failure(failure, now)
            self._poll()
            self._reap(now)
            self._maybe_evaluate(now)
            self.view.update(self._snapshot(now))
            reason = self._stop_reason(now)
            if reason:
                return reason
            time.sleep(self.s.poll_interval_s)

    def _stop_reason(self, now: float) -> str | None:
        if all(slot.state in ("finished", "failed") for slot in self.slots):
            return "every learner reached --max-steps" if any(s.state == "finished" for s in self.slots) else "every learner failed"
        if self.s.token_budget is not None and sum(slot.tokens for slot in self.slots) >= self.s.token_budget:
            return f"token budget of {self.s.token_budget:,} reached"
        if now >= self.s.time_limit_s:
            return f"time limit of {self.s.time_limit_s:g} s reached"
        return None

    def _group_of(self, slot: LearnerSlot) -> list[LearnerSlot]:
        """The processes that fail together: in ddp mode the whole unit (its ranks share every step)."""
        return [self.slots[i] for i in self.failures.group_of(slot.index)]

    def _apply_failure(self, failure: Failure, now: float) -> None:
        """A failure instant: kill the learner (its unit, in ddp mode) if it is up, and schedule its
        restart after the repair time; an instant that finds it down or finished is absorbed."""
        slot = self.slots[failure.learner]
        if not slot.up:
            return
        group = self._group_of(slot)
        if any(m.state == "finished" for m in group):
            # the ranks of a unit take every step together: one that finished means the unit's
            # last step is done and the others are only leaving
            self._note(f"[{now:6.1f}s] chaos: {self._who(slot)} not killed, its unit finished training")
            return
        for member in group:
            if member.up and member.child is not None:
                member.child.kill()
                self._mark_down(member, now, by_chaos=member is slot)
                member.down_until_s = now + self.s.repair_s
        self._note(f"[{now:6.1f}s] chaos: killed {self._who(slot)} at step {slot.step}{self._unit_note()}")

    def _logged_step(self, slot: LearnerSlot) -> int:
        """The newest step the learner's current process wrote to its metrics file (every 5 steps):
        fresher than the last heartbeat. In ddp mode rank 0's process writes the unit's file."""
        writer = self.slots[0] if self.s.mode == "ddp" else slot
        if writer.child is None:
            return 0
        counts = read_counts(self.paths.metrics_file(writer.index), pid=writer.child.pid)
        return counts.step if counts is not None else 0

    def _who(self, slot: LearnerSlot) -> str:
        return learner_label(self.s.mode, slot.index, slot.learner_id)

    def _unit_note(self) -> str:
        return f" (the unit's {self.s.learners} ranks fail and restart together)" if self.s.mode == "ddp" else ""

    def _mark_down(self, slot: LearnerSlot, now: float, *, by_chaos: bool) -> None:
        slot.state = "down"
        self.record.timeline.enter(slot.index, "down", now)
        if by_chaos:
            slot.step = max(slot.step, self._logged_step(slot))
            if slot.pending_kill is not None:  # killed again while it was still coming back
                slot.pending_kill.killed_again_at_s = now
            slot.pending_kill = KillRecord(slot.index, now, slot.step)
            self.record.kills.append(slot.pending_kill)

    def _reap(self, now: float) -> None:
        """Learner processes that exited on their own: finished (code 0) or crashed (restarted)."""
        for slot in self.slots:
            if slot.state == "down":
                if slot.down_until_s is not None and now >= slot.down_until_s:
                    slot.down_until_s = None
                    self._launch(slot)
                    if slot.pending_kill is not None:
                        slot.pending_kill.restarted_at_s = now
                        self._note(f"[{now:6.1f}s] chaos: restarted {self._who(slot)}{self._unit_note()}")
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
                self._note(f"[{now:6.1f}s] learner {slot.index} exited with code {code}; restarting")
            else:
                slot.state = "failed"
                self.record.timeline.leave(slot.index, now)
                self._note(f"[{now:6.1f}s] learner {slot.index} failed {slot.crashes + 1} times; see {slot.child.log_path if slot.child else ''}")

    def _note(self, message: str) -> None:
        self._notes.append(message)
        self.view.note(message)

    # ---- the synchronizer's status ----------------------------------------------------------------

    def _fetch_status(self) -> StatusResponse | None:
        """The synchronizer's ``/v1/status``, or None while it does not answer."""
        try:
            resp = self.http.get("/v1/status")
            if resp.status_code != 200:
                return None
            return StatusResponse.model_validate(resp.json())
        except (httpx.HTTPError, ValueError):
            return None

    def _poll(self) -> None:
        status = self._fetch_status()
        if status is None:
            return
        self.status = status
        now = self.now()
        by_id = {ls.learner_id: ls for ls in status.learners}
        for slot in self.slots:
            ls = by_id.get(slot.learner_id)
            if ls is None:
                continue
            if slot.state in ("starting", "rejoining") and has_rejoined(slot, ls, now):
                self._on_rejoined(slot, ls.step, now)
            if slot.state in ("training", "finished"):
                slot.step = max(slot.step, ls.step) if slot.incarnation == 0 else ls.step
                slot.tokens = slot.step * self.s.tokens_per_step
                slot.step_time_s = ls.step_time_s
                slot.tokens_per_s = self.s.tokens_per_step / ls.step_time_s if ls.step_time_s > 0 else 0.0
                slot.staleness = ls.staleness
                if self.s.mode != "ddp" or slot.index == 0:
                    self.record.timeline.record_blocked(slot.index, slot.incarnation, ls.blocked_s)
        self.record.sent_bytes = max(self.record.sent_bytes, status.bytes_in)
        self.record.received_bytes = max(self.record.received_bytes, status.bytes_out)
        self.record.rounds = status.rounds
        self.record.versions = {f.fragment: f.version for f in status.fragments}

    def _on_rejoined(self, slot: LearnerSlot, step: int, now: float) -> None:
        slot.state = "training"
        self.record.timeline.enter(slot.index, "training", now)
        kill = slot.pending_kill
        if kill is not None:
            kill.rejoined_at_s = now
            slot.pending_kill = None
            # the step it resumed from (its log says), not the one it already reached again by now
            start = resumed_step(slot.child.log_tail(200_000)) if slot.child is not None else None
            resumed = min(step, start) if start is not None else step
            self.record.timeline.rollbacks.append(Rollback(slot.index, now, kill.step, resumed, slot.step_time_s))
            self._note(f"[{now:6.1f}s] {self._who(slot)} rejoined at step {step} (killed at step {kill.step}, "
                       f"resumed from step {resumed})")
        slot.step = step

    # ---- global model evaluation ------------------------------------------------------------------

    def _evaluator(self) -> GlobalEvaluator | None:
        if self.evaluator is None:
            from diloco.runner.commands import CORPUS_BYTES

            s = self.s
            self.evaluator = GlobalEvaluator(
                sync_url=self.sync_url, job_secret=self.secret, model=s.model, corpus=s.data.corpus,
                eval_fraction=s.data.eval_fraction, batch_size=s.train.batch_size, fragments=s.algorithm().fragments,
                corpus_max_bytes=CORPUS_BYTES[s.device], device=f"cuda:{s.gpus[0]}" if s.device == "cuda" else "cpu",
            )
            self.record.num_params = self.evaluator.num_params
        return self.evaluator

    def _maybe_evaluate(self, now: float) -> None:
        versions = self.record.versions
        if not versions or min(versions.values()) < 0 or versions == self._last_versions:
            return
        if now - self._last_eval_s < EVAL_INTERVAL_S:
            return
        self._evaluate(now)

    def _evaluate(self, now: float) -> None:
        evaluator = self._evaluator()
        result = evaluator.evaluate() if evaluator is not None else None
        self._last_eval_s = now
        if result is None:
            return
        self._last_versions = result.versions
        tokens = sum(slot.tokens for slot in self.slots)
        self.record.losses.append(LossSample(wall_s=now, tokens=tokens, loss=result.loss))

    def _final_evaluation(self) -> None:
        if self.sync is None or not self.sync.alive() or not self.record.versions:
            return
        try:
            self._evaluate(self.now())
        except Exception as exc:  # the report must still be written
            log.warning("final evaluation failed: %s", exc)

    def _snapshot(self, now: float) -> Snapshot:
        rows = tuple(
            LearnerRow(slot.learner_id if self.s.mode != "ddp" else f"rank-{slot.index}", slot.state, slot.step,
                       slot.tokens_per_s if slot.state == "training" else 0.0, slot.staleness, slot.speed_factor)
            for slot in self.slots
        )
        return Snapshot(
            mode=self.s.mode, elapsed_s=now, learners=rows,
            version=max(self.record.versions.values(), default=-1), rounds=self.record.rounds,
            loss=self.record.losses[-1].loss if self.record.losses else None,
            bytes_sent=self.record.sent_bytes, tokens=sum(slot.tokens for slot in self.slots),
            notes=tuple(self._notes),
        )


def _child_env() -> dict[str, str]:
    return dict(os.environ)


def _settings_dict(settings: RunSettings) -> dict[str, object]:
    data = settings.model_dump(mode="json")
    data["algorithm"] = settings.algorithm().model_dump(mode="json") | {"blocking_sync": settings.blocking_sync}
    return data
