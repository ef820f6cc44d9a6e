"""Soak: kill -9 of the synchronizer at random moments during real S3 outages (SeaweedFS stopped),
with two learners contributing to two fragments all along. Every contribution answered ``durable``
is merged or still pending at the end (none lost), and every one answered as only buffered was sent
again until it was durable or a newer version superseded it (409 ``stale``).

``DILOCO_SOAK_PARAMS`` (say ``200e6``) runs it at a model size: two fragments of that many parameters
together, each learner's int4 outer gradient quantized once and framed on each base, versions read
from ``/v1/status`` rather than downloaded whole (the benchmark figures at size)."""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable

import numpy as np
import pytest
from diloco_bench.sync_ingest_payloads import framed, grad_parts, make_plan
from diloco_core import codec
from diloco_core.fragments import FragmentPlan
from diloco_testbed.s3_server import S3Server
from diloco_testbed.waiting import wait_for

from tests.synchronizer.conftest import SyncFactory
from tests.synchronizer.helpers import (
    Learner,
    SyncProcess,
    encode_grad,
    initial_params,
    outer_grad,
    tiny_plan,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
SIZE = int(float(os.environ.get("DILOCO_SOAK_PARAMS", "0")))  # 0: the tiny plan, fp32 contributions
PLAN: FragmentPlan = make_plan(SIZE, 2) if SIZE else tiny_plan()
ARGS = [
    "--fragments",
    "2",
    "--inner-steps",
    "4",
    "--overlap",
    "1",
    "--quorum",
    "2",
    "--storage-retry-max-s",
    "0.5",
]
OUTAGES = int(os.environ.get("DILOCO_SOAK_OUTAGES", "6"))  # more for the benchmark figures


class Tally:
    """What each learner was told about each of its contributions."""

    def __init__(self) -> None:
        self.durable: set[str] = set()
        self.buffered: dict[str, tuple[Learner, int, int, int, bytes]] = {}  # key -> what to resend
        self.superseded: set[str] = set()
        self.ever_buffered: set[str] = set()
        self.taken_anew = 0
        self.newest_base: dict[int, int] = {}  # fragment -> the newest base an accepted one was on

    def send(self, learner: Learner, p: int, base: int, seq: int, blob: bytes) -> bool:
        """Send one contribution; whether it was accepted (202)."""
        key = f"{learner.id}/{p}/{base}/{seq}"
        r = learner.contribute(p, base, blob, seq=seq)
        if r.status_code == 202:
            if r.json()["durable"]:
                if key in self.buffered and r.json()["status"] == "accepted":
                    self.taken_anew += 1  # the restarted synchronizer had lost it: the resend saved it
                self.durable.add(key)
                self.buffered.pop(key, None)
            else:
                self.buffered[key] = (learner, p, base, seq, blob)
                self.ever_buffered.add(key)
        elif r.status_code == 409 and r.json()["code"] in ("stale", "already_merged"):
            # a newer version is out, or this learner's progress on the base is being merged: these
            # learners send their whole progress from the base each time, so they take the new version
            self.superseded.add(key)
            self.buffered.pop(key, None)
        elif (
            r.status_code != 503
        ):  # 503: storage down and the memory budget full, or starting: sent again later
            raise AssertionError(f"{key}: {r.status_code} {r.text}")
        if r.status_code == 202:
            self.newest_base[p] = max(base, self.newest_base.get(p, base))
        return r.status_code == 202

    def resend_buffered(self) -> None:
        for learner, p, base, seq, blob in list(self.buffered.values()):
            self.send(learner, p, base, seq, blob)


def version(learner: Learner, p: int) -> int:
    if SIZE:  # the status says it without sending the whole version
        r = learner.client.get("/v1/status")
        r.raise_for_status()
        return int(next(f["version"] for f in r.json()["fragments"] if f["fragment"] == p))
    got = learner.fetch(p)
    assert got is not None
    return got[0]


class Gradients:
    """Each contribution's payload: a fresh fp32 outer gradient of the tiny plan, or at a model size
    one int4 gradient per learner and fragment, quantized once and framed on each base."""

    def __init__(self) -> None:
        self.parts: dict[tuple[int, int], dict[str, codec.QuantizedTensor]] = {}

    def payload(self, learner: int, p: int, base: int, seed: int) -> bytes:
        if not SIZE:
            return encode_grad(outer_grad(PLAN, p, seed=seed), p, base)
        parts = self.parts.get((learner, p))
        if parts is None:
            parts = self.parts[(learner, p)] = grad_parts(PLAN, p, seed=1000 * learner + p)
        return framed(parts, p, base)


def starting_params(p: int) -> dict[str, np.ndarray]:
    if not SIZE:
        return initial_params(PLAN, p)
    rng = np.random.default_rng(p)
    return {t.name: rng.standard_normal(t.shape, dtype=np.float32) for t in PLAN.fragments[p].tensors}


def round_keys(s3: S3Server, bucket: str) -> set[str]:
    client = s3.client()
    keys: set[str] = set()
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix="jobs/soak/shard-000/rounds/"
    ):
        for obj in page.get("Contents", []):
            entry = json.loads(client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
            keys.update(entry["merged_keys"])
            keys.update(e["key"] for e in entry.get("excluded", []))
    return keys


@pytest.mark.timeout(7200 if SIZE else 600)  # at a model size each outage takes minutes on two cores
def test_kill_9_during_storage_outages_loses_no_durable_contribution(
    sync_factory: SyncFactory, s3_server_factory: Callable[[], S3Server]
) -> None:
    rng = random.Random(14)
    s3 = s3_server_factory()
    bucket = s3.new_bucket()
    sync: SyncProcess = sync_factory(f"s3://{bucket}/jobs/soak", ARGS, s3.env())
    learners = [Learner(sync.url, name, PLAN) for name in ("a", "b")]
    for learner in learners:
        assert learner.register().status_code == 200
    for p in (0, 1):
        assert learners[0].init(p, starting_params(p)).status_code == 200
    tally, seq, gradients = Tally(), 0, Gradients()

    def contribute_once() -> None:
        nonlocal seq
        for p in (0, 1):
            for i, learner in enumerate(learners):
                base = version(learner, p)
                seq += 1
                tally.send(learner, p, base, seq, gradients.payload(i, p, base, seed=seq + i))

    def settle(seconds: float = 120.0) -> None:
        """Give the round of what was accepted time to be published, so that the learners contribute
        on its version next (to one still merging, as at a model size, they would only get 409
        ``already_merged``); a round that never comes (a lone contribution below the quorum) is not
        waited for longer. Nothing is checked here: the end checks every acknowledgement."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if all(version(learners[0], p) > b for p, b in tally.newest_base.items()):
                return
            time.sleep(0.2)

    for _ in range(OUTAGES):
        settle()
        contribute_once()
        settle()
        s3.stop()
        kill_at = rng.randrange(3)
        for step in range(3):  # contributions during the outage, and kill -9 at a random point among them
            if step == kill_at:
                sync.kill9()
                sync.start(wait_loaded=False)
                break
            contribute_once()
        s3.start()
        wait_for(sync._loaded, timeout=90, what="the restarted synchronizer to load its state")
        for learner in learners:
            learner.register()  # a restarted synchronizer remembers them; registering again is harmless
        tally.resend_buffered()
        wait_for(
            lambda: (tally.resend_buffered(), not tally.buffered)[1],
            timeout=60,
            what="every buffered one durable",
        )

    assert tally.durable, "no contribution was answered durable"
    assert tally.ever_buffered, "no contribution was only buffered: the outages did not happen"
    assert tally.taken_anew > 0, "no kill -9 lost a buffered contribution: the resends were not exercised"
    assert not tally.buffered  # every buffered one was resent until durable, or superseded
    # the end: nothing durable lost — each is merged (its key in a round log) or still pending in storage
    sync.kill9()
    sync.start()
    pending = {
        obj["Key"].removeprefix("jobs/soak/shard-000/pending/")
        for obj in s3.client()
        .list_objects_v2(Bucket=bucket, Prefix="jobs/soak/shard-000/pending/")
        .get("Contents", [])
    }
    pending_keys = {
        f"{k.split('/')[1]}/{k.split('/')[0]}/{k.split('/')[2].replace('-', '/').removesuffix('.bin')}"
        for k in pending
    }
    merged = round_keys(s3, bucket)
    lost = sorted(tally.durable - merged - pending_keys)
    print(
        f"outage soak ({PLAN.num_params:,} parameters): {OUTAGES} outages with a kill -9, {len(tally.durable)} contributions durable, "
        f"{len(tally.ever_buffered)} answered buffered ({tally.taken_anew} taken anew after a kill lost them, "
        f"{len(tally.ever_buffered & tally.superseded)} superseded by a newer version), "
        f"{len(tally.durable & merged)} merged, {len(tally.durable & pending_keys)} pending, {len(lost)} lost"
    )
    assert lost == [], f"{len(lost)} durable contributions lost of {len(tally.durable)}: {lost[:5]}"
