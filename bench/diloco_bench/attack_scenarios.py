"""The scenarios of `diloco bench attack` that each try one limit of the synchronizer: the norm
bound (``bound``), trickling uploads (``uploads``), other learner ids (``sybil``) and claims beyond
a token's (``claims``). Each returns its figures."""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from diloco_core import protocol as proto
from diloco_core.auth import learner_token
from diloco_core.bounds import MAX_TOKENS_PER_STEP
from diloco_core.request_proof import instance_at, prove
from diloco_worker.sync_client import SyncClient, SyncRejected, SyncUnavailable

from diloco_bench.attack_job import (
    SHAPES,
    H,
    client,
    clipped_count,
    fetch_newer,
    grad_blob,
    in_newest_round,
    init_params,
    job_args,
    join,
    norm_of,
    of_norm,
    plan,
)
from diloco_bench.sync_process import SECRET, BenchSync


def bound(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The run with whole fp32 versions down (what is read is the global model itself), then the same
    run with the job's default int2 downloads (what a learner receives: the version plus its
    download residual, which the synchronizer's error feedback carries to the next version)."""
    figures = _bound(args, tmp / "fp32", "fp32")
    received = _bound(args, tmp / "int2", "int2")
    figures["largest_movement_received_with_int2_downloads"] = received["largest_movement"]
    return figures


def _bound(args: argparse.Namespace, tmp: Path, down_codec: str) -> dict[str, Any]:
    the_plan, rng, factor = plan(), np.random.default_rng(args.seed), 10.0
    outer = ("--outer-lr", "1", "--outer-momentum", "0", "--outer-warmup", "0", "--down-codec", down_codec)
    sync = BenchSync(tmp / "bound", job_args(2, *outer))
    sync.start()
    h, x = client(sync, "honest"), client(sync, "adversary")
    try:
        for c in (h, x):
            join(c, the_plan)
        init = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES}
        init_params(h, init)
        heavy = {"steps": H, "tokens": H * MAX_TOKENS_PER_STEP}
        version, values, seq = 0, init, 0
        largest, merged_x, clipped_x, probes_clipped, probes = 0.0, 0, 0, 0, 0
        restarted_clipped = None

        def one_round(x_norm: float) -> bool:
            """Both learners contribute on the current version; True when the adversary's was merged
            scaled down to its limit (``clipped``)."""
            nonlocal version, values, seq, largest, merged_x
            seq += 1
            before_clipped = clipped_count(h)
            h.contribute(
                0, grad_blob(of_norm(rng, 1.0), version), base_version=version, steps=H, tokens=8 * H, seq=seq
            )
            x.contribute(0, grad_blob(of_norm(rng, x_norm), version), base_version=version, seq=seq, **heavy)
            before = values
            version, values = fetch_newer(h, the_plan, version)
            largest = max(largest, norm_of({n: values[n] - before[n] for n in values}))
            merged_x += in_newest_round(h, "adversary")
            return clipped_count(h) > before_clipped

        for i in range(args.rounds):
            if i == args.rounds // 2:
                sync.kill9()
                sync.start()
                for c in (h, x):
                    join(c, the_plan)
                restarted_clipped = one_round(5.0 * norm_of(values))
                continue
            probe = i >= 2 and i % args.probe_every == 0
            clipped = one_round((factor + 1.0) if probe else (args.ratio if i >= 2 else 1.0))
            probes += probe
            probes_clipped += probe and clipped
            clipped_x += clipped
        return {
            "rounds": args.rounds,
            "largest_movement": largest,
            "bound": factor,
            "adversary_merged": merged_x,
            "adversary_clipped": clipped_x,
            "probes_above_the_limit_clipped": f"{probes_clipped}/{probes}",
            "after_kill9_5x_params_norm_clipped": restarted_clipped,
        }
    finally:
        h.close()
        x.close()
        sync.stop()


def uploads(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    the_plan = plan()
    sync = BenchSync(tmp / "uploads", job_args(2, "--header-timeout-s", "2", "--min-body-rate", "100"))
    sync.start()
    a, b = client(sync, "trickler"), client(sync, "honest")
    socks: list[socket.socket] = []
    try:
        for c in (a, b):
            join(c, the_plan)
        zeros = {name: np.zeros(shape, np.float32) for name, shape in SHAPES}
        init_params(a, zeros)
        target = "/v1/fragments/0/contributions?base_version=0&steps=4&tokens=32&seq=1"
        token, instance = learner_token(SECRET, "trickler"), instance_at(sync.url + proto.API_PREFIX)
        refused = 0
        for _ in range(args.uploads):
            proof = prove(token, "POST", target, instance=instance)
            head = (  # each upload signed on its own, as a learner's requests are
                f"POST {target} HTTP/1.1\r\nHost: synchronizer\r\nContent-Length: 5000\r\n"
                f"Authorization: {proof}\r\n{proto.LEARNER_HEADER}: trickler\r\n\r\n"
            ).encode()
            s = socket.create_connection(("127.0.0.1", sync.port), timeout=10)
            s.sendall(head + b"\x00")
            socks.append(s)
        for s in socks:
            s.settimeout(0.2)
            with contextlib.suppress(TimeoutError):
                refused += s.recv(4096).startswith(b"HTTP/1.1 429 ")
        probes = answered = honest = honest_ok = 0
        seq, closed, deadline = 0, 0, time.monotonic() + args.seconds
        while time.monotonic() < deadline:
            probes += 1
            with contextlib.suppress(httpx.HTTPError):
                answered += httpx.get(f"{sync.url}/healthz", timeout=5).status_code == 200
            seq += 1
            honest += 1
            blob = grad_blob({name: np.full(shape, 0.01, np.float32) for name, shape in SHAPES}, 0)
            try:
                b.contribute(0, blob, base_version=0, steps=1, tokens=8, seq=seq, since=seq - 1)
                honest_ok += 1
            except (SyncRejected, SyncUnavailable):
                pass
            closed = 0
            for s in socks:
                try:
                    s.send(b"\x00")
                except OSError:
                    closed += 1
            time.sleep(0.5)
        return {
            "uploads_opened": args.uploads,
            "refused_at_once_429": refused,
            "closed_by_the_server": closed,
            "healthz_answered": f"{answered}/{probes}",
            "honest_contributions_accepted": f"{honest_ok}/{honest}",
        }
    finally:
        for s in socks:
            s.close()
        a.close()
        b.close()
        sync.stop()


def sybil(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    the_plan = plan()
    sync = BenchSync(tmp / "sybil", job_args(1))
    sync.start()
    own = learner_token(SECRET, "holder", tokens_per_step=8)
    prefix, payload, mac = own.split(".")
    accepted, tried = 0, 0
    try:
        for i in range(args.ids):
            lid = f"sybil-{i}"
            claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
            renamed = (
                base64.urlsafe_b64encode(json.dumps({**claims, "sub": lid}).encode()).rstrip(b"=").decode()
            )
            for token in (own, f"{prefix}.{renamed}.{mac}"):
                c = SyncClient(sync.url, lid, token, timeout_s=30.0)
                tried += 1
                try:
                    join(c, the_plan)
                    accepted += 1
                except (SyncRejected, SyncUnavailable):
                    pass
                finally:
                    c.close()
        return {"ids_tried": args.ids, "registrations_tried": tried, "registered": accepted}
    finally:
        sync.stop()


def claims(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    the_plan, rng = plan(), np.random.default_rng(args.seed)
    revocations = tmp / "revocations.json"
    revocations.write_text("{}")
    sync = BenchSync(
        tmp / "claims",
        job_args(2, "--min-step-time-s", "0.01", "--revocations-file", str(revocations)),
    )
    sync.start()
    now = int(time.time())
    honest = SyncClient(
        sync.url, "honest", learner_token(SECRET, "honest", tokens_per_step=8), timeout_s=30.0
    )
    x = SyncClient(sync.url, "x", learner_token(SECRET, "x", tokens_per_step=8, generation=1), timeout_s=30.0)
    refused: dict[str, int] = {"more_tokens_than_declared": 0, "more_steps_than_the_age_allows": 0,
                               "expired_token": 0, "revoked_generation": 0, "another_learners_token": 0}  # fmt: skip
    tries = 0
    try:
        for c in (honest, x):
            join(c, the_plan)
        init = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES}
        init_params(honest, init)
        blob = grad_blob(of_norm(rng, 1.0), 0)

        def refused_as(kind: str, call: Callable[[], object]) -> None:
            try:
                call()
            except SyncRejected:
                refused[kind] += 1

        others = {
            "expired_token": learner_token(SECRET, "x", tokens_per_step=8, expires_at=now - 3600),
            "revoked_generation": learner_token(SECRET, "x", tokens_per_step=8, generation=0),
            "another_learners_token": learner_token(SECRET, "honest", tokens_per_step=8),
        }
        revocations.write_text(json.dumps({"x": 1}))
        time.sleep(1.5)  # the synchronizer re-reads it within a second
        for seq in range(1, args.tries + 1):
            tries += 1
            refused_as(
                "more_tokens_than_declared",
                lambda seq=seq: x.contribute(0, blob, base_version=0, steps=H, tokens=8 * H + 1, seq=seq),  # type: ignore[misc]
            )
            refused_as(
                "more_steps_than_the_age_allows",
                lambda seq=seq: x.contribute(0, blob, base_version=0, steps=10**6, tokens=8 * 10**6, seq=seq),  # type: ignore[misc]
            )
            for kind, token in others.items():
                c = SyncClient(sync.url, "x", token, timeout_s=30.0)
                refused_as(kind, lambda c=c: c.heartbeat(proto.Heartbeat(step=1, tokens=8, step_time_s=0.1)))  # type: ignore[misc]
                c.close()
        honest.contribute(0, blob, base_version=0, steps=H, tokens=8 * H, seq=1)
        x.contribute(
            0, grad_blob(of_norm(rng, 1.0), 0), base_version=0, steps=H, tokens=8 * H, seq=args.tries + 1
        )
        version, _ = fetch_newer(honest, the_plan, 0)
        return {
            "tries_of_each": tries,
            **{f"{k}_refused": v for k, v in refused.items()},
            "honest_and_x_within_its_claims_merged": version == 1,
        }
    finally:
        honest.close()
        x.close()
        sync.stop()
