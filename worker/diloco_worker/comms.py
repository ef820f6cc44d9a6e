"""Background communication of one learner: the training thread never waits on the network.

- one queue per fragment: every outer gradient is sent, in order (each carries only the progress
  made since the one before it, so none may be skipped); a sender thread per synchronizer shard
  sends the queues of the fragments that shard owns, and retries failures with exponential backoff
  and jitter; one answered as only buffered (``durable: false``: the synchronizer's storage is
  down) is sent again every ``BUFFERED_RESEND_S`` with the same sequence number until an answer says
  it is durable (a synchronizer that restarted and lost it takes it anew, one that wrote it answers
  ``duplicate``), or until the learner took a newer version of the fragment (which supersedes it);
  a later part refused as ``out_of_order`` (the restarted synchronizer lacks the buffered ones
  before it) sends the buffered parts at once, in order, and itself after them;
- one long-poll thread per fragment, asking the fragment's shard, that fetches new global versions
  into an arrivals slot, which the training loop drains at a step boundary; with
  ``announce_rounds`` it also hears when a round on the learner's version opens, and leaves a
  request the training loop answers (:mod:`.pull`);
- a heartbeat thread per shard reporting progress (step, tokens, step time, blocked time, bytes sent).

So a shard that is down delays only its own fragments' sends and keeps only its own heartbeats failing.
The senders are ``sender.Sender``'s, the long-polls ``poller.Poller``'s; ``Communicator`` starts them
and runs the heartbeats.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import threading
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from diloco_core import bounds
from diloco_core import protocol as proto
from diloco_core.fragments import FragmentPlan

from .fragment_state import Outgoing
from .pacing import backoff_delay
from .poller import Held, Poller
from .sender import Sender
from .sync_client import ShardClients, SyncBadAnswer, SyncClient, SyncRejected, SyncUnavailable

log = logging.getLogger("diloco_worker.comms")


def heartbeat_failure_level(exc: SyncUnavailable, attempt: int) -> int:
    """How loudly a failed heartbeat (the ``attempt``-th in a row) is logged: a refusal for the clock
    (401 ``clock_skew``, which no retry cures until a clock is set right) or an answer that is not the
    synchronizer's (``SyncBadAnswer``: something in front of it answers in its place) as a warning at
    the first failure and every 20th after; anything else (a restart, a blip) at debug."""
    telling = "clock_skew" in str(exc) or isinstance(exc, SyncBadAnswer)
    return logging.WARNING if telling and (attempt == 1 or attempt % 20 == 0) else logging.DEBUG


def _within(seconds: float, high: float) -> float:
    """A measured duration as reported: in [0, high], 0 when it is not a number."""
    return min(max(seconds, 0.0), high) if math.isfinite(seconds) else 0.0


@dataclass
class Progress:
    """What heartbeats report; written by the training loop, read by the heartbeat thread."""

    step: int = 0
    tokens: int = 0
    step_time_s: float = 0.0
    fragment_steps: dict[int, int] = field(default_factory=dict)
    fragment_tokens: dict[int, int] = field(default_factory=dict)
    eval_loss: float | None = None
    blocked_s: float = 0.0
    state: proto.LearnerState = "training"


@dataclass(frozen=True)
class CommSettings:
    codec: str = "int4"  # the job's codec: the quantizer of the outer gradients on the wire
    heartbeat_interval_s: float = 2.0
    poll_wait_s: float = 10.0
    bandwidth_limit: float = 0.0
    announce_rounds: bool = False  # ask to hear of rounds this learner should join (partial progress)
    # keep each fragment's newest version in host memory, so that the next one can come as the update
    # from it (the job's ``down_codec``, ``diloco_core.downlink``)
    hold_versions: bool = False


class Communicator:
    """A learner's sender, pollers and heartbeats (``Sender``, ``Poller``, the heartbeat loop here);
    the training thread's calls never block on the network."""

    def __init__(
        self,
        client: SyncClient | ShardClients,
        plan: FragmentPlan,
        settings: CommSettings,
        *,
        versions: dict[int, int],
        on_unknown_learner: Callable[[int], None] = lambda shard: None,
        stage: Callable[[int, dict[str, np.ndarray]], Mapping[str, np.ndarray]] = lambda p, arrays: arrays,
        held: Held | None = None,
    ) -> None:
        """``client``: one synchronizer, or the clients of every shard; ``on_unknown_learner(shard)``
        is called when a shard no longer knows this learner (it registers again there); ``stage(p,
        arrays)`` prepares a decoded global version in the poller thread (the learner's device copy);
        ``held``: global versions the learner holds exactly, whole as decoded (with ``hold_versions``,
        the next versions of those fragments can come as updates)."""
        self.shards = (
            client if isinstance(client, ShardClients) else ShardClients.single(client, len(plan.fragments))
        )
        self.plan, self.settings = plan, settings
        self.progress = Progress()
        self._on_unknown = on_unknown_learner
        self._stop = threading.Event()
        self.poller = Poller(
            self.shards, plan, settings, self._stop, versions=versions, stage=stage, held=held
        )
        self.sender = Sender(
            self.shards,
            settings.codec,
            settings.bandwidth_limit,
            self._stop,
            known_version=self.poller.known_version,
            resync=self.poller.resync,
            step=lambda: self.progress.step,
        )
        self._rng = random.Random()
        self._threads: list[threading.Thread] = []
        for i in self.shards.indices:  # contributions and long-polls carry the heartbeats they can
            self.shards.shard(i).beats.carry(self.heartbeat, settings.heartbeat_interval_s)

    def start(self) -> None:
        targets: list[tuple[str, Callable[[], None]]] = []
        for i in self.shards.indices:
            suffix = f"-{i}" if self.shards.routes.num_shards > 1 else ""
            targets += [
                (f"sender{suffix}", functools.partial(self.sender.send_loop, i)),
                (f"heartbeat{suffix}", functools.partial(self._hb_loop, i)),
            ]
        targets += [
            (f"poll-{f.index}", functools.partial(self.poller.poll_loop, f.index))
            for f in self.plan.fragments
        ]
        for name, fn in targets:
            t = threading.Thread(target=fn, name=f"diloco-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    # ---- called by the training thread (never blocks on the network) ----
    def submit(self, c: Outgoing) -> None:
        self.sender.submit(c)

    def take_arrivals(self) -> dict[int, tuple[int, Mapping[str, np.ndarray]]]:
        return self.poller.take_arrivals()

    def requests(self) -> dict[int, int]:
        return self.poller.requests()

    def answered(self, p: int) -> None:
        self.poller.answered(p)

    def pending(self, p: int) -> bool:
        return self.sender.pending(p)

    def buffered(self, p: int) -> list[int]:
        return self.sender.buffered(p)

    def unacknowledged(self) -> list[Outgoing]:
        return self.sender.unacknowledged()

    def wait_for_arrival(self, fragments: Collection[int], timeout_s: float) -> bool:
        return self.poller.wait_for_arrival(fragments, timeout_s)

    def resync(self, p: int) -> None:
        self.poller.resync(p)

    def held_versions(self) -> Held:
        return self.poller.held_versions()

    @property
    def bytes_sent(self) -> int:
        return self.sender.bytes_sent

    @property
    def sent(self) -> int:
        return self.sender.sent

    @property
    def rejected(self) -> int:
        return self.sender.rejected

    @property
    def updates(self) -> int:
        return self.poller.updates

    # ---- shutdown ----
    def flush(self, timeout_s: float) -> bool:
        """Wait until the pending contributions are sent (or given up); True when nothing is left."""
        return self.sender.flush(timeout_s)

    def stop(self) -> None:
        self._stop.set()
        self.sender.wake()

    def leave(self, timeout_s: float, learner_id: str) -> tuple[bool, bool]:
        """Send what is pending (for half of ``timeout_s``), stop the threads, and tell every shard,
        side by side, the final progress and that this learner leaves (a quarter each); (everything
        was sent, every shard heard it)."""
        flushed = self.flush(timeout_s / 2)
        self.stop()
        shards = self.shards.indices
        with ThreadPoolExecutor(max_workers=len(shards)) as pool:
            told = all(list(pool.map(lambda i: self._say_goodbye(i, timeout_s / 4, learner_id), shards)))
        return flushed, told

    def _say_goodbye(self, shard: int, budget_s: float, learner_id: str) -> bool:
        client = self.shards.shard(shard)
        try:
            client.heartbeat(self.heartbeat(), timeout_s=budget_s)
            client.leave(timeout_s=budget_s)
        except (SyncUnavailable, SyncRejected) as exc:
            log.warning("learner=%s shard=%d could not announce leaving: %s", learner_id, shard, exc)
            return False
        return True

    # ---- the heartbeat thread ----
    def _hb_loop(self, shard: int) -> None:
        """Keep this learner alive on ``shard`` (each shard has its own learner registry): a heartbeat
        request whenever nothing carried one for an interval (``carried_beats``). An unexpected
        failure is logged and retried after a backoff: the thread lives as long as the learner."""
        client, attempt, every_s = self.shards.shard(shard), 0, self.settings.heartbeat_interval_s
        delay = every_s
        while not self._stop.wait(delay):
            if attempt == 0 and (owed_in := client.beats.due_in(every_s)) > 0:
                delay = owed_in  # a contribution or a long-poll carried one meanwhile
                continue
            try:
                client.heartbeat(self.heartbeat())
                attempt = 0
            except SyncUnavailable as exc:
                attempt += 1
                log.log(heartbeat_failure_level(exc, attempt), "shard=%d heartbeat failed: %s", shard, exc)
            except SyncRejected as exc:
                attempt += 1
                if exc.status in (401, 404):
                    log.warning("shard=%d does not know this learner (%s); registering again", shard, exc)
                    try:
                        self._on_unknown(shard)
                    except Exception as reg_exc:  # a failed re-registration is retried on the next beat
                        log.warning("re-registration failed: %s", reg_exc)
            except Exception:
                attempt += 1
                log.exception("shard=%d heartbeat failed unexpectedly, will retry", shard)
            delay = every_s if attempt == 0 else backoff_delay(attempt, self._rng)

    def wire_bytes(self) -> tuple[int, int]:
        """Bytes at the socket this learner's connections sent and received so far (every shard's)."""
        return self.shards.home().wire.totals()

    def heartbeat(self) -> proto.Heartbeat:
        """The progress to report, within the bounds the synchronizer accepts (a diverged model's NaN
        loss is not reported: the synchronizer would refuse the whole heartbeat)."""
        p = self.progress
        loss = p.eval_loss
        wire_sent, wire_received = self.wire_bytes()
        return proto.Heartbeat(
            step=min(max(0, p.step), bounds.MAX_STEPS),
            tokens=min(max(0, p.tokens), bounds.MAX_TOKENS),
            step_time_s=_within(p.step_time_s, bounds.MAX_STEP_TIME_S),
            state=p.state,
            fragment_steps={k: min(max(0, v), bounds.MAX_STEPS) for k, v in p.fragment_steps.items()},
            fragment_tokens={k: min(max(0, v), bounds.MAX_TOKENS) for k, v in p.fragment_tokens.items()},
            eval_loss=loss
            if loss is not None and math.isfinite(loss) and abs(loss) <= bounds.MAX_LOSS
            else None,
            bytes_sent=min(self.sender.bytes_sent, bounds.MAX_BYTES),
            wire_sent=min(wire_sent, bounds.MAX_BYTES),
            wire_received=min(wire_received, bounds.MAX_BYTES),
            blocked_s=_within(p.blocked_s, bounds.MAX_SECONDS),
        )
