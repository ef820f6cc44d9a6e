"""`diloco bench attack`'s ``capture`` scenario: what an eavesdropper on a learner's link (plain
HTTP, a proxy's log) can do with what it reads. It records the learner's requests whole (head and
body) and sends them again: each contribution as it was, its proof on the learner's ``leave`` route,
its proof on the same route with another query (more steps), its proof a window later, the learner's
whole token as a bearer (what a learner sent before requests were signed), each heartbeat's proof
with a forged body (a step time of a day) to the job's other shard, and, once the synchronizer was
killed and restarted, every contribution again. Figures: how many of each were refused, and that
the learner's own next requests still work and it never left."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from diloco_core import protocol as proto
from diloco_core.auth import learner_token
from diloco_core.request_proof import PROOF_WINDOW_S, ProofAuth, prove, request_target

from diloco_bench.attack_job import SHAPES, H, client, grad_blob, init_params, job_args, join, of_norm, plan
from diloco_bench.sync_process import SECRET, BenchSync

KINDS = (
    "same_request_again",
    "proof_on_leave",
    "proof_with_more_steps",
    "proof_a_window_later",
    "bearer_token",
    "heartbeat_forged_to_another_shard",
    "same_request_after_a_restart",
)


def _refused(resp: httpx.Response) -> bool:
    return resp.status_code == 401


def _captured(resp: httpx.Response, learner: str) -> dict[str, str]:
    """The headers that authenticated a request, as read off the wire."""
    return {"Authorization": resp.request.headers["authorization"], proto.LEARNER_HEADER: learner}


def _two_shards(tmp: Path) -> tuple[BenchSync, BenchSync]:
    """Shard 0 (which owns the fragment) and shard 1 of one job: two processes, one job secret."""
    shards = [BenchSync(tmp / f"capture-shard-{i}", []) for i in (0, 1)]
    urls = ",".join(s.url for s in shards)
    for i, s in enumerate(shards):  # a quorum of 2: the victim's parts wait, in order
        s.args = job_args(2, "--num-shards", "2", "--shard-index", str(i), "--shard-urls", urls)
        s.start()
    return shards[0], shards[1]


def capture(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    the_plan, rng = plan(), np.random.default_rng(args.seed)
    sync, shard_1 = _two_shards(tmp)
    victim, learner = client(sync, "victim"), "victim"
    token = learner_token(SECRET, learner)
    proof_auth = ProofAuth(token)
    signed = httpx.Client(base_url=sync.url, auth=proof_auth, headers={proto.LEARNER_HEADER: learner})
    raw = httpx.Client(base_url=sync.url)
    refused = dict.fromkeys(KINDS, 0)
    captured: list[tuple[dict[str, Any], bytes, dict[str, str]]] = []
    try:
        join(victim, the_plan)
        on_shard_1 = client(shard_1, learner)
        join(on_shard_1, the_plan)
        on_shard_1.close()
        init_params(victim, {name: np.zeros(shape, np.float32) for name, shape in SHAPES})
        route = proto.API_PREFIX + proto.CONTRIBUTIONS_PATH.format(p=0)
        beat_route = proto.API_PREFIX + proto.HEARTBEAT_PATH.format(learner_id=learner)
        for seq in range(1, args.tries + 1):
            blob = grad_blob(of_norm(rng, 1.0), 0)
            query = {"base_version": 0, "since": (seq - 1) * H, "steps": H, "tokens": 8 * H, "seq": seq}
            # the learner's own request, read off the wire
            sent = signed.post(route, params=query, content=blob)
            assert sent.status_code == 202, sent.text
            seen = _captured(sent, learner)
            captured.append((query, blob, seen))
            leave = proto.API_PREFIX + proto.LEAVE_PATH.format(learner_id=learner)
            more = {**query, "steps": 10 * H, "tokens": 80 * H}
            bearer = {**seen, "Authorization": f"Bearer {token}"}
            attempts: dict[str, tuple[str, dict[str, Any], bytes, dict[str, str]]] = {
                "same_request_again": (route, query, blob, seen),
                "proof_on_leave": (leave, {}, b"", seen),
                "proof_with_more_steps": (route, more, blob, seen),
                "bearer_token": (route, query, blob, bearer),
            }
            for kind, (path, params, body, head) in attempts.items():
                refused[kind] += _refused(raw.post(path, params=params, content=body, headers=head))
            url = raw.build_request("POST", route, params=query).url  # the proof of a request held back
            target, instance = request_target(url.path, url.query), proof_auth.instance
            header = prove(token, "POST", target, instance=instance, now=time.time() - PROOF_WINDOW_S - 60)
            refused["proof_a_window_later"] += _refused(
                raw.post(route, params=query, content=blob, headers={**seen, "Authorization": header})
            )
            beat = signed.post(beat_route, json={"step": seq * H, "tokens": 8 * seq * H, "step_time_s": 0.1})
            assert beat.status_code == 200, beat.text
            forged = {"step": seq * H, "tokens": 8 * seq * H, "step_time_s": 86_400.0}
            to_shard_1 = httpx.post(shard_1.url + beat_route, json=forged, headers=_captured(beat, learner))
            refused["heartbeat_forged_to_another_shard"] += _refused(to_shard_1)
        sync.kill9()
        sync.start()
        for query, blob, seen in captured:
            again = raw.post(route, params=query, content=blob, headers=seen)
            refused["same_request_after_a_restart"] += _refused(again)
        beat = victim.heartbeat(proto.Heartbeat(step=1, tokens=8, step_time_s=0.1))
        states = {x.learner_id: x.state for x in victim.status().learners}
        return {
            "tries_of_each": args.tries,  # each contribution of the tries was replayed after the restart
            **{f"{k}_refused": v for k, v in refused.items()},
            "learner_still_served": beat is not None and states.get(learner) != "left",
        }
    finally:
        for c in (signed, raw):
            c.close()
        victim.close()
        sync.stop()
        shard_1.stop()
