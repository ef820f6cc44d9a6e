"""Liveness of the job watch: pure decisions (tables of cases), and the probe against a real apiserver."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import kopf
import pytest
from diloco_operator.glue.handlers import probe
from diloco_operator.kube import Kube
from diloco_operator.runtime.liveness import WatchState, lagging, paused_by_peers, watch_is_alive
from diloco_operator.runtime.metrics import OperatorMetrics
from diloco_operator.runtime.passes import Context
from diloco_operator.runtime.pods import PodCache, PodWatch
from diloco_operator.settings import settings_from_env
from kubernetes import client as k8s

from tests.operator.kubejobs import GROUP, PLURAL, VERSION, create_job, get_job, job_manifest, unit

NOW = 1000.0


@pytest.mark.parametrize(
    ("listed", "seen", "due", "expected"),
    [
        ({}, {}, {}, {}),  # idle: no jobs, nothing due
        ({"a": "5"}, {"a": "5"}, {}, {}),  # the watch delivered what the API holds
        ({"a": "6"}, {"a": "5"}, {}, {"a": NOW}),  # a newer version: due from now
        ({"a": "7"}, {"a": "5"}, {"a": 900.0}, {"a": 900.0}),  # still behind: keeps the first time
        ({"a": "7"}, {"a": "7"}, {"a": 900.0}, {}),  # caught up
        ({}, {"a": "5"}, {"a": 900.0}, {}),  # deleted: nothing more to deliver
        ({"b": "1"}, {}, {}, {"b": NOW}),  # created, never delivered
    ],
    ids=["idle", "caught-up", "newer", "still-behind", "caught-up-later", "deleted", "never-seen"],
)
def test_lagging(
    listed: dict[str, str], seen: dict[str, str], due: dict[str, float], expected: dict[str, float]
) -> None:
    assert lagging(listed, seen, due, NOW) == expected


@pytest.mark.parametrize(
    ("due", "threshold", "alive"),
    [
        ({}, 60.0, True),  # an idle operator is live however long it has heard nothing
        ({"a": NOW}, 60.0, True),  # just found behind: the event may be on its way
        ({"a": NOW - 60.0}, 60.0, True),
        ({"a": NOW - 61.0}, 60.0, False),
        ({"a": NOW - 1.0, "b": NOW - 120.0}, 60.0, False),  # one stream dead among several
    ],
    ids=["idle", "just-due", "at-threshold", "past-threshold", "one-of-two"],
)
def test_watch_is_alive(due: dict[str, float], threshold: float, alive: bool) -> None:
    assert watch_is_alive(due, NOW, threshold) is alive


def test_an_event_clears_what_was_due() -> None:
    state = WatchState(seen={"a": "5"}, due={"a": 900.0})
    state.heard("a", "6", deleted=False)
    assert (state.seen, state.due) == ({"a": "6"}, {})
    state.heard("a", "7", deleted=True)
    assert state.seen == {}
    assert state.compare({"a": "8", "b": "1"}, NOW) == {"a": NOW, "b": NOW}
    state.heard("b", "1", deleted=False)
    assert state.compare({"a": "8", "b": "1"}, NOW + 5) == {"a": NOW}
    state.pause()
    assert state.due == {}


T = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def peer(priority: int, age: float = 1.0, lifetime: int = 60) -> dict[str, Any]:
    return {"priority": priority, "lifetime": lifetime, "lastseen": (T - timedelta(seconds=age)).isoformat()}


@pytest.mark.parametrize(
    ("peers", "priority", "paused"),
    [
        ({"me": peer(10)}, 10, False),  # alone
        ({"me": peer(10), "other": peer(5)}, 10, False),  # the other one waits
        ({"me": peer(5), "other": peer(10)}, 5, True),  # outranked
        ({"me": peer(5), "other": peer(10, age=120)}, 5, False),  # the higher one is dead
        ({"me": peer(5), "other": peer(5)}, 5, True),  # same priority: kopf pauses both
        ({"me": {"priority": 5}}, 5, False),  # no lastseen: counted as seen now
        ({"other": peer(5)}, 5, True),  # own entry not written yet: the other one still counts
        ({"me": peer(5, age=120), "other": peer(5)}, 5, True),  # own keepalive late: same as kopf
        ({"me": peer(10, age=120)}, 10, False),  # own entry stale, nobody else: not paused
        ({"other": peer(5, age=120)}, 5, False),  # only a dead peer
    ],
    ids=[
        "alone",
        "highest",
        "outranked",
        "outranker-dead",
        "tie",
        "no-lastseen",
        "own-missing",
        "own-stale-tie",
        "own-stale-alone",
        "dead-peer",
    ],
)
def test_paused_by_peers(peers: dict[str, Any], priority: int, paused: bool) -> None:
    assert paused_by_peers({"status": peers}, priority, T, "me") is paused


def test_missing_peering_object_counts_as_paused() -> None:
    assert paused_by_peers(None, 0, T, "me") is True


@pytest.mark.integration
def test_probe_fails_when_the_watch_does_not_deliver_a_job(api: k8s.ApiClient, namespace: str) -> None:
    """The probe handler against a real apiserver, without kopf: nothing feeds ``WatchState`` here,
    which is exactly what a dead watch looks like (a hung stream cannot be produced on demand
    without breaking the shared control plane), then the events a live watch would deliver."""
    settings = settings_from_env(
        {"DILOCO_OPERATOR_WATCH_STALE_SECONDS": "0.001", "DILOCO_OPERATOR_METRICS_PORT": "0"}
    )
    ctx = Context(
        settings,
        Kube(api),
        lambda url: None,
        OperatorMetrics(),
        random.Random(0),
        PodCache(),
        PodWatch(),
        WatchState(),
        [namespace],
        ThreadPoolExecutor(1),
        "test",
    )
    memo = kopf.Memo(ctx=ctx)
    kopf_settings = kopf.OperatorSettings()
    kopf_settings.peering.standalone = True
    assert probe(memo=memo, settings=kopf_settings) == "ok"  # no job: nothing is due
    create_job(api, namespace, job_manifest("unheard", [unit("a")]))
    assert probe(memo=memo, settings=kopf_settings) == "ok"  # just found behind
    with pytest.raises(kopf.PermanentError, match="has not delivered 1 job change"):
        probe(memo=memo, settings=kopf_settings)
    meta = get_job(api, namespace, "unheard")["metadata"]
    ctx.watch.heard(meta["uid"], meta["resourceVersion"], deleted=False)  # what a live watch does
    assert probe(memo=memo, settings=kopf_settings) == "ok"
    # Gone before the namespace is: operators of later tests watch every namespace.
    k8s.CustomObjectsApi(api).delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "unheard")
