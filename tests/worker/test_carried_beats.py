"""When a learner's contributions carry its heartbeat, and when its heartbeat thread owes one of its own."""

from __future__ import annotations

import json

from diloco_core.protocol import HEARTBEAT_HEADER, HEARTBEAT_RECORDED_HEADER, Heartbeat
from diloco_worker.carried_beats import CarriedBeats


def test_requests_carry_a_heartbeat_once_half_an_interval_passed_since_the_last_sent() -> None:
    now = [100.0]
    beats = CarriedBeats(clock=lambda: now[0])
    assert beats.header(now[0]) == {}  # nothing to carry yet
    assert beats.due_in(10.0) <= 0  # none recorded: the heartbeat thread owes one
    beats.carry(lambda: Heartbeat(step=7, tokens=56, step_time_s=0.5), every_s=10.0)
    carried = beats.header(now[0])
    assert json.loads(carried[HEARTBEAT_HEADER]) == {"step": 7, "tokens": 56, "step_time_s": 0.5}  # compact
    assert beats.header(now[0]) == {}  # one is on its way: a request sent meanwhile carries none
    assert beats.due_in(10.0) == 5.0  # nor does the heartbeat thread send one within half an interval
    beats.answered(now[0], {})  # an answer without the mark (a synchronizer that ignores the header)
    now[0] += 5.0
    assert beats.due_in(10.0) <= 0  # so the heartbeat thread sends its own
    beats.sending(now[0])
    assert beats.header(now[0]) == {}  # two heartbeats are never sent less than half an interval apart
    beats.beat(now[0])  # recorded
    assert beats.due_in(10.0) == 10.0
    now[0] += 5.0
    assert HEARTBEAT_HEADER in beats.header(now[0])  # half an interval: the next contribution carries one
    beats.answered(now[0], {HEARTBEAT_RECORDED_HEADER: "1"})
    assert beats.due_in(10.0) == 10.0  # recorded: the heartbeat thread owes none for an interval


def test_an_answer_arriving_late_counts_from_when_its_request_was_sent() -> None:
    now = [0.0]
    beats = CarriedBeats(clock=lambda: now[0])
    beats.beat(5.0)
    beats.answered(2.0, {HEARTBEAT_RECORDED_HEADER: "1"})  # a long-poll sent before the last beat
    now[0] = 6.0
    assert beats.due_in(10.0) == 9.0  # the newer beat holds
