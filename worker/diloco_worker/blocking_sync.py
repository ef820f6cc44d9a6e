"""The wait of blocking sync (``--blocking-sync``, synchronous DiLoCo): after sending its due
fragments, a learner takes the arriving global versions until each of them has a new one.

Rank 0 waits at most ``BLOCK_TICK_S`` at a time and then tells its peers, so that the other ranks of
a unit (waiting in the broadcast) never reach their collective timeout. A stop request ends the
wait, and so does a job whose remaining learners can no longer fill a round (the others finished
and left, :func:`.lockstep.round_can_close`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from diloco_core.fragments import FragmentPlan

from .comms import Communicator
from .distributed import Arrivals, Unit
from .handshake import JobTerms
from .lockstep import round_can_close
from .sync_client import SyncRejected, SyncUnavailable
from .train import LoopState

log = logging.getLogger("diloco_worker.session")
BLOCK_TICK_S = 1.0  # a blocked learner looks at arrivals, stop requests and its unit this often
MEMBERS_CHECK_S = 3.0  # and asks this often whether the learners still in the job can close the round


class BlockingSync:
    """The waits of one learner; remembers whether the job was last found short of learners."""

    def __init__(
        self,
        unit: Unit,
        plan: FragmentPlan,
        terms: JobTerms,
        *,
        learner_id: str,
        stop: threading.Event,
        apply: Callable[[Arrivals, int], None],
        beat: Callable[[str], None],
    ) -> None:
        """``apply(arrivals, step)`` takes global versions in; ``beat(phase)``: a sign of life per tick."""
        self.unit, self.plan, self.terms, self.learner_id = unit, plan, terms, learner_id
        self.stop, self._apply, self._beat = stop, apply, beat
        self._short_of_learners = False

    def await_globals(
        self, comm: Communicator | None, waiting: set[int], state: LoopState, t0: float
    ) -> bool:
        """Take arriving global versions until every fragment of ``waiting`` has a new one; returns the
        unit-wide stop decision. ``comm``: rank 0's communicator (None on the other ranks); ``t0``:
        when the step boundary began."""
        stop, released = False, False
        # once the job could not fill a round, ask again on the first tick of every later wait
        last_check = float("-inf") if self._short_of_learners else time.monotonic()
        while waiting and not stop and not released:
            arrivals: Arrivals = {}
            if comm is not None:
                comm.wait_for_arrival(waiting, BLOCK_TICK_S)
                arrivals = comm.take_arrivals()
                stop = self.stop.is_set()
                comm.progress.blocked_s = state.blocked_s + time.perf_counter() - t0
                if time.monotonic() - last_check >= MEMBERS_CHECK_S:
                    last_check, released = time.monotonic(), not self._round_can_close(comm)
                    self._short_of_learners = released
            stop, arrivals = self.unit.boundary(stop, arrivals, self.plan)
            released = self.unit.share_flag(released)
            self._apply(arrivals, state.step)
            waiting -= arrivals.keys()
            self._beat("blocked")
        if waiting:
            why = "stop requested" if stop else "too few learners left to close the round"
            log.info(
                "learner=%s step=%d %s; no longer waiting for fragments %s",
                self.learner_id,
                state.step,
                why,
                sorted(waiting),
            )
        return stop

    def _round_can_close(self, comm: Communicator) -> bool:
        """Asks the synchronizer which learners are still in the job (unreachable: assume they are)."""
        try:
            learners = comm.shards.home().status().learners
        except (SyncUnavailable, SyncRejected):
            return True
        return round_can_close((lr.state for lr in learners), self.terms.quorum)
