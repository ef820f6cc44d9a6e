"""`diloco bench attack`'s ``capture`` scenario: what an eavesdropper on a learner's link (plain
HTTP, a proxy's log) can do with what it reads. It records the learner's requests whole (head and
body) and sends them again: each request as it was, its proof on the learner's ``leave`` route, its
proof on the same route with another query (more steps), its proof a window later, and the learner's
whole token as a bearer (what a learner sent before requests were signed). Figures: how many of each
were refused, and that the learner's own next requests still work and it never left."""

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
)


def _refused(resp: httpx.Response) -> bool:
    return resp.status_code == 401


def capture(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    the_plan, rng = plan(), np.random.default_rng(args.seed)
    sync = BenchSync(tmp / "capture", job_args(2))  # a quorum of 2: the victim's parts wait, in order
    sync.start()
    victim, learner = client(sync, "victim"), "victim"
    token = learner_token(SECRET, learner)
    signed = httpx.Client(base_url=sync.url, auth=ProofAuth(token), headers={proto.LEARNER_HEADER: learner})
    raw = httpx.Client(base_url=sync.url)
    refused = dict.fromkeys(KINDS, 0)
    try:
        join(victim, the_plan)
        init_params(victim, {name: np.zeros(shape, np.float32) for name, shape in SHAPES})
        route = proto.API_PREFIX + proto.CONTRIBUTIONS_PATH.format(p=0)
        for seq in range(1, args.tries + 1):
            blob = grad_blob(of_norm(rng, 1.0), 0)
            query = {"base_version": 0, "since": (seq - 1) * H, "steps": H, "tokens": 8 * H, "seq": seq}
            # the learner's own request, read off the wire
            sent = signed.post(route, params=query, content=blob)
            assert sent.status_code == 202, sent.text
            seen = {"Authorization": sent.request.headers["authorization"], proto.LEARNER_HEADER: learner}
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
            header = prove(
                token, "POST", request_target(url.path, url.query), now=time.time() - PROOF_WINDOW_S - 60
            )
            refused["proof_a_window_later"] += _refused(
                raw.post(route, params=query, content=blob, headers={**seen, "Authorization": header})
            )
        beat = victim.heartbeat(proto.Heartbeat(step=1, tokens=8, step_time_s=0.1))
        states = {x.learner_id: x.state for x in victim.status().learners}
        return {
            "tries_of_each": args.tries,
            **{f"{k}_refused": v for k, v in refused.items()},
            "learner_still_served": beat is not None and states.get(learner) != "left",
        }
    finally:
        for c in (signed, raw):
            c.close()
        victim.close()
        sync.stop()
