"""One storage prefix, one job: real synchronizer processes on a file:// store and on S3. A second
job on a prefix refuses to start; a synchronizer whose prefix another job took stops writing and
exits with the reason; the same job restarting resumes its state."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

import httpx
import pytest
from diloco_core.ownership import CONFLICT, MARKER_KEY, encode_marker, new_marker, parse_marker
from diloco_core.storage import ObjectStore, open_store
from diloco_testbed.waiting import wait_for

from tests.synchronizer.conftest import StoreTarget, SyncFactory
from tests.synchronizer.helpers import SECRET, Learner, encode_grad, initial_params, outer_grad, tiny_plan

pytestmark = pytest.mark.integration
PLAN = tiny_plan()
ARGS = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--quorum", "1", "--job-id", "llm"]


def _owner(name: str) -> list[str]:
    return [*ARGS, "--job-owner", name]


def _open(store: StoreTarget, url: str, monkeypatch: pytest.MonkeyPatch) -> ObjectStore:
    for name, value in store.env.items():
        monkeypatch.setenv(name, value)
    return open_store(url)


def _run_to_exit(store: StoreTarget, url: str, args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **store.env, "DILOCO_JOB_SECRET": SECRET}
    command = [sys.executable, "-m", "diloco_sync", "--storage", url, "--port", "0", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=False)


def _started(learner: Learner) -> None:
    assert learner.register().status_code == 200
    for p in (0, 1):
        assert learner.init(p, initial_params(PLAN, p)).status_code == 200


def test_a_second_job_on_the_prefix_refuses_to_start(
    store: StoreTarget, sync_factory: SyncFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = store.url("shared")
    first = sync_factory(url, _owner("team-a/llm"), store.env)
    # the same job name in another namespace is another job
    second = _run_to_exit(store, url, _owner("team-b/llm"))
    assert second.returncode == 1, second.stderr
    last = second.stderr.strip().splitlines()[-1]  # a container's termination message ends with it
    assert last.startswith(f"diloco synchronizer: cannot start: {CONFLICT}: "), last
    assert "'team-a/llm'" in last
    assert "'team-b/llm'" in last
    assert "give this job its own storage prefix" in last

    assert httpx.get(f"{first.url}/readyz", timeout=5).json()["ready"] is True  # the owner is untouched
    learner = Learner(first.url, "a", PLAN)
    _started(learner)
    learner.close()
    marker = parse_marker(_open(store, url, monkeypatch).get(MARKER_KEY), url)
    assert (marker.owner, marker.job_id) == ("team-a/llm", "llm")


def test_a_synchronizer_whose_prefix_was_taken_stops_writing_and_exits(
    store: StoreTarget, sync_factory: SyncFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = store.url("taken")
    sync = sync_factory(url, _owner("team-a/llm"), store.env)
    learner = Learner(sync.url, "a", PLAN)
    _started(learner)
    objects = _open(store, url, monkeypatch)
    manifest = objects.get("shard-000/manifest.json")
    objects.put(MARKER_KEY, encode_marker(new_marker("team-b/llm", "llm", 1.0)))  # another job takes it

    taken = learner.contribute(0, 0, encode_grad(outer_grad(PLAN, 0, seed=1), 0, 0))
    assert taken.status_code == 202, taken.text  # quorum 1: its round's commit finds the prefix taken
    wait_for(lambda: not sync.process.running(), timeout=60, what="the synchronizer to exit")
    learner.close()
    assert sync.process.returncode() == 1, sync.process.failure_report()
    said = sync.log_path.read_text(encoding="utf-8", errors="replace")
    # whichever write notices first (the round's commit, the learner registry's save) says it in one
    # line; a round that was under way when the server stopped is not committed either way
    assert "stopping all writes: " + CONFLICT in said
    assert "Traceback" not in said
    assert "round failed" not in said
    last = said.strip().splitlines()[-1]
    assert last.startswith(f"diloco synchronizer: stopped: {CONFLICT}: "), last
    assert "'team-b/llm'" in last
    assert objects.get("shard-000/manifest.json") == manifest  # the round was never committed
    assert not objects.exists("shard-000/fragments/0/params-0000000001.bin")
    assert parse_marker(objects.get(MARKER_KEY), url).owner == "team-b/llm"


@pytest.mark.slow
def test_the_same_owner_restarting_resumes(store: StoreTarget, sync_factory: SyncFactory) -> None:
    url = store.url("resumed")
    first = sync_factory(url, _owner("team-a/llm"), store.env)
    learner = Learner(first.url, "a", PLAN)
    _started(learner)
    assert learner.contribute(0, 0, encode_grad(outer_grad(PLAN, 0, seed=1), 0, 0)).status_code == 202
    got = learner.fetch(0, newer_than=0, wait=30)
    assert got is not None
    assert got[0] == 1
    learner.close()
    first.stop()

    again = sync_factory(url, _owner("team-a/llm"), store.env)  # the job created again: same owner
    status = httpx.get(f"{again.url}/v1/status", timeout=5).json()
    assert {f["fragment"]: f["version"] for f in status["fragments"]} == {0: 1, 1: 0}
