"""The learner's answer to a round that asks for its partial progress, and the switch that turns it off."""

from __future__ import annotations

from typing import Any

import pytest
from diloco_worker.pull import should_send_partial
from diloco_worker.settings import SettingsError, parse_settings

BASE: dict[str, Any] = {"requested_version": 3, "base_version": 3, "steps": 2, "sent_at": 0, "pending": False}


def _decide(change: dict[str, Any]) -> bool:
    args: dict[str, Any] = {**BASE, **change}
    return bool(should_send_partial(**args))


def test_a_ready_learner_answers_a_round_on_its_version() -> None:
    assert _decide({})
    assert _decide({"steps": 1})


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"requested_version": None}, "no round asked"),
        ({"requested_version": 2}, "a round on an older version"),
        ({"requested_version": 4}, "a version this learner does not have yet"),
        ({"steps": 0}, "not ready: no step since the version arrived"),
        ({"steps": -1}, "a streaming fragment still before its offset"),
        ({"sent_at": 2}, "already sent since that version: never twice into one round"),
        ({"pending": True}, "an outer gradient of the fragment is still on its way"),
        ({"requested_version": -1, "base_version": -1}, "no global version yet"),
    ],
)
def test_a_learner_does_not_answer(change: dict[str, Any], why: str) -> None:
    assert not _decide(change), why


def test_partial_contributions_are_on_by_default_and_can_be_turned_off() -> None:
    base = ["--sync-url", "http://x", "--token", "t"]
    assert parse_settings(base, env={}).partial_contributions
    assert not parse_settings([*base, "--no-partial-contributions"], env={}).partial_contributions
    assert not parse_settings(base, env={"DILOCO_PARTIAL_CONTRIBUTIONS": "0"}).partial_contributions
    with pytest.raises(SettingsError, match="DILOCO_PARTIAL_CONTRIBUTIONS"):
        parse_settings(base, env={"DILOCO_PARTIAL_CONTRIBUTIONS": "maybe"})
