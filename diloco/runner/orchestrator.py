"""The run: one synchronizer, N learner processes, chaos, progress and the record of what happened.

All decisions (the chaos schedule, goodput, the report) are pure functions elsewhere; this module
runs the loop and the synchronizer process, :mod:`diloco.runner.learners` the learner processes,
and both feed facts to the record with times measured from the start of the job.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from types import FrameType

import httpx
from diloco_core.progress import time_left
from diloco_core.protocol import StatusResponse
from diloco_core.wire import WireTally
from diloco_worker.wire_transport import counting_transport

from diloco.runner.chaos import build_chaos_schedule, due_events
from diloco.runner.commands import RunPaths, build_synchronizer_argv, build_synchronizer_env
from diloco.runner.evaluation import GlobalEvaluator, LossTracker
from diloco.runner.learners import Learners
from diloco.runner.processes import Child, free_port, launch, stop_all
from diloco.runner.record import LossSample, RunRecord
from diloco.runner.settings import RunSettings
from diloco.runner.view import LearnerRow, ProgressView, Snapshot

SETTLE_S = 30.0  # how long the final evaluation waits for the last contributions to be merged
log = logging.getLogger(__name__)

EVAL_INTERVAL_S = 3.0


class RunError(RuntimeError):
    """The run could not start (the message says why and where the logs are)."""


class Orchestrator:
    def __init__(
        self,
        settings: RunSettings,
        paths: RunPaths,
        view: ProgressView,
        clock: Callable[[], float] = time.monotonic,
        *,
        resumed: bool = False,
    ) -> None:
        """``resumed``: the run continues one stopped in the same folder (``--resume``)."""
        self.s, self.paths, self.view, self.clock = settings, paths, view, clock
        self.secret = secrets.token_hex(16)
        self.port = settings.port or free_port(settings.host)
        self.sync_url = f"http://{settings.host}:{self.port}"
        self.record = RunRecord(
            run_dir=str(paths.root),
            mode=settings.mode,
            settings=_settings_dict(settings),
            started_at=time.time(),
            tokens_per_step=settings.tokens_per_step,
            resumed=resumed,
        )
        self._notes: list[str] = []
        self.learners = Learners(
            settings,
            paths,
            self.record,
            sync_url=self.sync_url,
            job_secret=self.secret,
            master_port=free_port(settings.host),
            note=self._note,
        )
        self.schedule = build_chaos_schedule(settings)
        self.sync: Child | None = None
        self.losses = LossTracker(self._make_evaluator, EVAL_INTERVAL_S)
        self.wire = WireTally()  # the runner's own connections to the synchronizer (not the learners')
        self.http = httpx.Client(base_url=self.sync_url, timeout=5.0, transport=counting_transport(self.wire))
        self.t0 = clock()
        self.stop_requested = False
        self.status: StatusResponse | None = None

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
        self.losses.load()  # loads PyTorch and the held-out data before the clock starts
        if self.stop_requested:
            return "while loading the evaluator"
        self.t0 = self.clock()
        self.record.started_at = time.time()  # the job's time 0 on the wall clock (learners report on it)
        for slot in self.learners:
            if self.stop_requested:
                return f"after launching {slot.index} of {len(self.learners.slots)} learners"
            self.learners.launch(slot, self.now())
        return None

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.stop_requested = True

    def _start_synchronizer(self) -> None:
        """Launch the synchronizer and wait until it answers (or a stop request ends the wait)."""
        argv = build_synchronizer_argv(self.s, self.paths, port=self.port)
        env = build_synchronizer_env(dict(os.environ), job_secret=self.secret)
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
        raise RunError(
            f"the synchronizer did not answer on {self.sync_url} within 60 s; see {self.sync.log_path}"
        )

    def _shutdown(self) -> None:
        now = self.now()
        stop_all(self.learners.live_children(), self.s.stop_timeout_s)
        self._poll()  # the learners' last heartbeats and bytes
        self.learners.count_unrecovered_losses(now)
        self.record.timeline.close(now)
        self.learners.take_own_reports(self.record.started_at)
        self._final_evaluation()
        if self.sync is not None:
            stop_all([self.sync], self.s.stop_timeout_s)
        self.http.close()
        self.losses.close()
        self.record.duration_s = now
        self.record.learners = self.learners.totals()

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
                self.learners.apply_failure(failure, now)
            self._poll()
            self.learners.reap(now)
            if self.losses.due(self.record.versions, now):
                self._evaluate(now)
            self.view.update(self._snapshot(now))
            reason = self._stop_reason(now)
            if reason:
                return reason
            time.sleep(self.s.poll_interval_s)

    def _stop_reason(self, now: float) -> str | None:
        slots = self.learners.slots
        if all(slot.state in ("finished", "failed") for slot in slots):
            return (
                "every learner reached --max-steps"
                if any(s.state == "finished" for s in slots)
                else "every learner failed"
            )
        if self.s.token_budget is not None and sum(slot.tokens for slot in slots) >= self.s.token_budget:
            return f"token budget of {self.s.token_budget:,} reached"
        if now >= self.s.time_limit_s:
            return f"time limit of {self.s.time_limit_s:g} s reached"
        return None

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

    def _poll(self) -> StatusResponse | None:
        """Take in the synchronizer's status; returns it (None while it does not answer)."""
        status = self._fetch_status()
        if status is None:
            return None
        self.status = status
        self.learners.update({ls.learner_id: ls for ls in status.learners}, self.now())
        self.record.sent_bytes = max(self.record.sent_bytes, status.bytes_in)
        # what the learners received (the evaluation's own fetches of the global model are not theirs)
        received = sum(ls.bytes_received for ls in status.learners)
        self.record.received_bytes = max(self.record.received_bytes, received)
        own_sent, own_received = self.wire.totals()
        self.record.wire_sent_bytes = max(self.record.wire_sent_bytes, status.wire_in - own_sent)
        self.record.wire_received_bytes = max(self.record.wire_received_bytes, status.wire_out - own_received)
        self.record.rounds = status.rounds
        self.record.versions = {f.fragment: f.version for f in status.fragments}
        return status

    # ---- global model evaluation ------------------------------------------------------------------

    def _make_evaluator(self) -> GlobalEvaluator:
        from diloco.runner.commands import CORPUS_BYTES

        s = self.s
        evaluator = GlobalEvaluator(
            sync_url=self.sync_url,
            job_secret=self.secret,
            model=s.model,
            data=s.data,
            batch_size=s.batch_size_of(0),
            fragments=s.algorithm().fragments,
            corpus_max_bytes=CORPUS_BYTES[s.device],
            precision=s.train.precision,
            device=f"cuda:{s.gpus[0]}" if s.device == "cuda" else "cpu",
            wire=self.wire,
        )
        self.record.num_params = evaluator.num_params
        return evaluator

    def _evaluate(self, now: float) -> None:
        loss = self.losses.evaluate(now)
        if loss is not None:
            tokens = sum(slot.tokens for slot in self.learners)
            self.record.losses.append(LossSample(wall_s=now, tokens=tokens, loss=loss))

    def _final_evaluation(self) -> None:
        if self.sync is None or not self.sync.alive() or not self.record.versions:
            return
        self._settle()
        try:
            self._evaluate(self.now())
        except Exception as exc:  # the report must still be written
            log.warning("final evaluation failed: %s", exc)

    def _settle(self) -> None:
        """Wait (at most ``SETTLE_S``) until the synchronizer has merged what the learners sent last, so
        that the final evaluation is of the versions the job ends with (what ``diloco export`` reads)."""
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            status = self._poll()
            if status is not None and all(f.pending == 0 for f in status.fragments):
                return
            time.sleep(0.2)
        log.warning(
            "contributions still pending after %.0f s: the final evaluation is of the versions so far",
            SETTLE_S,
        )

    def _snapshot(self, now: float) -> Snapshot:
        rows = tuple(
            LearnerRow(
                slot.learner_id if self.s.mode != "ddp" else f"rank-{slot.index}",
                slot.state,
                slot.step,
                slot.tokens_per_s if slot.state == "training" else 0.0,
                slot.staleness,
                slot.speed_factor,
            )
            for slot in self.learners
        )
        tokens = sum(slot.tokens for slot in self.learners)
        return Snapshot(
            mode=self.s.mode,
            elapsed_s=now,
            learners=rows,
            version=max(self.record.versions.values(), default=-1),
            rounds=self.record.rounds,
            loss=self.record.losses[-1].loss if self.record.losses else None,
            bytes_sent=self.record.sent_bytes,
            tokens=tokens,
            notes=tuple(self._notes),
            eta_s=run_time_left(self.s, now, tokens, [slot.step for slot in self.learners]),
        )


def run_time_left(settings: RunSettings, elapsed_s: float, tokens: int, steps: list[int]) -> float | None:
    """Seconds until the run's first budget is spent at the pace so far: its time limit, its token
    budget, or every learner's steps (the slowest learner's)."""
    if elapsed_s <= 0:
        return None
    slowest = min(steps, default=0)
    left: float | None = time_left(
        [
            (elapsed_s, settings.time_limit_s, 1.0),
            (tokens, settings.token_budget or math.inf, tokens / elapsed_s),
            (slowest, settings.train.max_steps, slowest / elapsed_s),
        ]
    )
    return left


def _settings_dict(settings: RunSettings) -> dict[str, object]:
    data = settings.model_dump(mode="json")
    data["algorithm"] = settings.algorithm().model_dump(mode="json") | {
        "blocking_sync": settings.blocking_sync
    }
    return data
