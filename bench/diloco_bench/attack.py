"""`diloco bench attack`: what one learner with a valid token can do to a job, against a real
synchronizer process (file storage), driven through the learner's own client
(``diloco_worker.sync_client``). Each scenario prints its figures:

- ``bound``: an honest learner sends outer gradients of norm 1 each round; an adversarial one, with
  the most tokens per step it may claim (so the largest merge weight), sends just inside the norm
  limit every round (``--ratio`` times the honest norm), tries a little above it every
  ``--probe-every`` rounds, and, after a kill -9 of the synchronizer halfway, five times the
  parameters' norm. Figures: rounds, the largest movement of the global model in a round against
  the bound (``max_update_norm_factor`` x the honest norm with outer lr 1 and no momentum), the
  adversary's contributions merged and excluded, and whether the limit grew.
- ``uploads``: one learner opens ``--uploads`` contribution uploads and sends a byte of each now and
  then; meanwhile ``/healthz`` is probed and an honest learner contributes every half second.
  Figures: uploads refused at once (429), closed for their rate, probes answered, honest
  contributions accepted.
- ``sybil``: a learner that holds its own token (what a unit's pod holds) tries to register
  ``--ids`` other learner ids: with its own token, and with its token's claims rewritten to name the
  other id. Figure: how many were accepted.
- ``claims``: with tokens that declare 8 tokens per step (as the operator mints them): contributions
  claiming more tokens than that, more steps than the version's age allows, an expired token, a
  revoked generation (the revocations file), another learner's token. Figures: how many of each
  were refused, and that the next round merged the honest learner's contribution and the
  adversary's own within its claims.
- ``continuations``: a learner sends its progress in parts (``since``), the synchronizer is killed
  with kill -9 at random moments (``--kills``) and the learner resends what was not answered, in
  order. Figures: parts acknowledged, steps acknowledged and steps merged (each step once), parts
  refused ``out_of_order`` and taken after their predecessors.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import json
import random
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from diloco_core import codec
from diloco_core import protocol as proto
from diloco_core.auth import learner_token
from diloco_core.bounds import MAX_TOKENS_PER_STEP
from diloco_core.fragments import FragmentPlan, build_plan
from diloco_worker.sync_client import GlobalFragment, SyncClient, SyncRejected, SyncUnavailable

from diloco_bench.sync_process import SECRET, BenchSync

H = 4
SHAPES = [("w", (64, 32)), ("b", (32,))]
SCENARIOS = ("bound", "uploads", "sybil", "claims", "continuations")


def plan() -> FragmentPlan:
    return build_plan(SHAPES, 1, H, 1)


def job_args(quorum: int, *extra: str) -> list[str]:
    return [
        "--fragments",
        "1",
        "--inner-steps",
        str(H),
        "--overlap",
        "1",
        "--quorum",
        str(quorum),
        "--merge-rule",
        "mean",
        "--log-level",
        "WARNING",
        *extra,
    ]


def client(sync: BenchSync, learner: str) -> SyncClient:
    return SyncClient(sync.url, learner, learner_token(SECRET, learner), timeout_s=30.0)


def join(c: SyncClient, the_plan: FragmentPlan, tokens_per_step: int = 8) -> None:
    c.register(
        proto.RegisterRequest(
            learner_id=c.learner_id,
            unit=f"unit-{c.learner_id}",
            plan=the_plan.to_dict(),
            plan_hash=the_plan.hash(),
            tokens_per_step=tokens_per_step,
        )
    )
    c.heartbeat(proto.Heartbeat(step=0, tokens=0, step_time_s=0.0))


def of_norm(rng: np.random.Generator, norm: float) -> dict[str, np.ndarray]:
    """An outer gradient of exactly (to float32) this norm."""
    g = {name: rng.standard_normal(shape) for name, shape in SHAPES}
    total = float(np.sqrt(sum(float(np.sum(v * v)) for v in g.values())))
    return {name: (v * (norm / total)).astype(np.float32) for name, v in g.items()}


def norm_of(tensors: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in tensors.values())))


def grad_blob(tensors: dict[str, np.ndarray], base: int) -> bytes:
    return bytes(codec.encode(tensors, fragment=0, base_version=base, kind="outer_grad", quantizer="fp32"))


def fetch_newer(c: SyncClient, the_plan: FragmentPlan, newer_than: int) -> tuple[int, dict[str, np.ndarray]]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = c.fetch(0, newer_than=newer_than, wait_s=10.0)
        if isinstance(got, GlobalFragment):
            payload = codec.decode(got.payload, fragment=the_plan.fragments[0])
            return got.version, dict(payload.tensors)
    raise RuntimeError(f"no version newer than {newer_than} within 60 s")


def excluded_count(c: SyncClient) -> int:
    return int(c.status().fragments[0].excluded)


# -- scenarios -------------------------------------------------------------------------------------


def bound(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    the_plan, rng, factor = plan(), np.random.default_rng(args.seed), 10.0
    sync = BenchSync(tmp / "bound", job_args(2, "--outer-lr", "1", "--outer-momentum", "0"))
    sync.start()
    h, x = client(sync, "honest"), client(sync, "adversary")
    try:
        for c in (h, x):
            join(c, the_plan)
        init = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES}
        h.init_fragment(0, codec.encode(init, fragment=0, base_version=0, kind="params", quantizer="fp32"))
        heavy = {"steps": H, "tokens": H * MAX_TOKENS_PER_STEP}
        version, values, seq = 0, init, 0
        largest, merged_x, excluded_x, probes_excluded, probes = 0.0, 0, 0, 0, 0
        restarted_excluded = None

        def one_round(x_norm: float) -> bool:
            """Both learners contribute on the current version; True when the adversary's was excluded."""
            nonlocal version, values, seq, largest
            seq += 1
            before_excluded = excluded_count(h)
            h.contribute(
                0, grad_blob(of_norm(rng, 1.0), version), base_version=version, steps=H, tokens=8 * H, seq=seq
            )
            x.contribute(0, grad_blob(of_norm(rng, x_norm), version), base_version=version, seq=seq, **heavy)
            before = values
            version, values = fetch_newer(h, the_plan, version)
            largest = max(largest, norm_of({n: values[n] - before[n] for n in values}))
            return excluded_count(h) > before_excluded

        for i in range(args.rounds):
            if i == args.rounds // 2:
                sync.kill9()
                sync.start()
                for c in (h, x):
                    join(c, the_plan)
                restarted_excluded = one_round(5.0 * norm_of(values))
                continue
            probe = i >= 2 and i % args.probe_every == 0
            excluded = one_round((factor + 1.0) if probe else (args.ratio if i >= 2 else 1.0))
            probes += probe
            probes_excluded += probe and excluded
            merged_x += not excluded
            excluded_x += excluded
        return {
            "rounds": args.rounds,
            "largest_movement": largest,
            "bound": factor,
            "adversary_merged": merged_x,
            "adversary_excluded": excluded_x,
            "probes_above_the_limit_excluded": f"{probes_excluded}/{probes}",
            "after_kill9_5x_params_norm_excluded": restarted_excluded,
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
        a.init_fragment(0, codec.encode(zeros, fragment=0, base_version=0, kind="params", quantizer="fp32"))
        head = (
            "POST /v1/fragments/0/contributions?base_version=0&steps=4&tokens=32&seq=1 HTTP/1.1\r\n"
            "Host: synchronizer\r\nContent-Length: 5000\r\n"
            f"Authorization: Bearer {learner_token(SECRET, 'trickler')}\r\n{proto.LEARNER_HEADER}: trickler\r\n\r\n"
        ).encode()
        refused = 0
        for _ in range(args.uploads):
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
        honest.init_fragment(
            0, codec.encode(init, fragment=0, base_version=0, kind="params", quantizer="fp32")
        )
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


def continuations(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """A learner sends its progress in parts of 1-4 steps (``since``), in order, each resent until
    answered; a second learner's contribution after each part makes the quorum of 2 merge. kill -9
    at random moments. A refused part (its base stale, say) makes the learner take the current
    version, which supersedes its unmerged parts on the old base (by design: its local progress is
    overwritten). From the round logs: steps merged twice, and acknowledged steps neither merged,
    nor superseded, nor still pending (lost)."""
    the_plan, rng, pyrng = plan(), np.random.default_rng(args.seed), random.Random(args.seed)
    store, log = tmp / "continuations", tmp / "continuations.log"
    sync = BenchSync(store, job_args(2, "--log-level", "INFO"), log=log)
    sync.start()
    a, b = client(sync, "parts"), client(sync, "other")
    stop, kills = threading.Event(), 0
    try:
        for c in (a, b):
            join(c, the_plan)
        zeros = {name: np.zeros(shape, np.float32) for name, shape in SHAPES}
        a.init_fragment(0, codec.encode(zeros, fragment=0, base_version=0, kind="params", quantizer="fp32"))

        def killer() -> None:
            nonlocal kills
            while kills < args.kills and not stop.wait(pyrng.uniform(0.5, 2.0)):
                sync.kill9()
                sync.start()
                kills += 1

        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        acked: dict[str, tuple[int, int, int]] = {}  # key -> (base, since, steps)
        superseded: set[str] = set()
        refused: dict[str, int] = {}
        other_refused: dict[str, int] = {}
        other_at: dict[int, int] = {}  # the other learner's progress sent per version (its ``since``)
        seq, version, since = 0, 0, 0
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline or thread.is_alive():
            steps = pyrng.randint(1, 4)
            seq += 1
            blob = grad_blob(of_norm(rng, 0.01 * steps), version)
            answer = _until_answered(
                functools.partial(
                    a.contribute,
                    0,
                    blob,
                    base_version=version,
                    steps=steps,
                    tokens=8 * steps,
                    seq=seq,
                    since=since,
                )
            )
            if isinstance(answer, SyncRejected):
                refused[answer.code] = refused.get(answer.code, 0) + 1
                superseded |= {k for k, (base, _, _) in acked.items() if base == version}
                version, since = _current(a), 0  # take the current version: progress starts afresh
                continue
            acked[f"parts/0/{version}/{seq}"] = (version, since, steps)
            since += steps
            for _ in range(10):  # the other learner's next step on the current version, until taken
                other = _current(b)
                other_blob = grad_blob(of_norm(rng, 0.01), other)
                taken = _until_answered(
                    functools.partial(
                        b.contribute,
                        0,
                        other_blob,
                        base_version=other,
                        steps=1,
                        tokens=8,
                        seq=seq,
                        since=other_at.get(other, 0),
                    )
                )
                if not isinstance(taken, SyncRejected):
                    other_at[other] = other_at.get(other, 0) + 1
                    break
                other_refused[taken.code] = other_refused.get(taken.code, 0) + 1
        stop.set()
        thread.join(timeout=120)
        settle, last = time.monotonic() + 30, (-1, -1)  # the last round merges after the last answer
        while time.monotonic() < settle:
            fragment = a.status().fragments[0]
            if (fragment.version, fragment.pending) == last and not fragment.pending:
                break  # nothing pending, and no round committed for a second: settled
            last = (fragment.version, fragment.pending)
            time.sleep(1.0)
        merged: dict[str, int] = {}
        for entry in _round_logs(store):
            for key in entry["merged_keys"]:
                merged[key] = merged.get(key, 0) + 1
        pending = a.status().fragments[0].pending
        held = {  # what is still pending, as stored (waiting for a quorum or its missing part)
            f"{path.parent.name}/0/{path.stem.replace('-', '/')}"
            for path in store.glob("shard-*/pending/0/*/*.bin")
        }
        steps_of = {key: steps for key, (_, _, steps) in acked.items()}
        lost = [k for k in acked if k not in merged and k not in superseded and k not in held]
        return {
            "kills": kills,
            "parts_acknowledged": len(acked),
            "steps_acknowledged": sum(steps_of.values()),
            "steps_merged": sum(steps_of.get(k, 0) for k in merged),
            "steps_merged_twice": sum(steps_of.get(k, 0) * (n - 1) for k, n in merged.items()),
            "steps_superseded_by_a_newer_version": sum(steps_of[k] for k in superseded if k not in merged),
            "steps_unaccounted": sum(steps_of[k] for k in lost),
            "learner_contributions_still_pending": pending,
            "steps_still_pending": sum(steps_of[k] for k in held if k in steps_of and k not in merged),
            "refused": refused,
            "other_refused": other_refused,
            "unaccounted": {
                k: [line for line in log.read_text().splitlines() if k in line][-3:] for k in lost[:3]
            },
        }
    finally:
        stop.set()
        a.close()
        b.close()
        sync.stop()


def _until_answered(call: Callable[[], proto.ContributionResult]) -> proto.ContributionResult | SyncRejected:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            return call()
        except SyncRejected as exc:
            return exc
        except SyncUnavailable:
            time.sleep(0.2)
    raise RuntimeError("no answer within 120 s")


def _current(c: SyncClient) -> int:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            return int(c.status().fragments[0].version)
        except (SyncUnavailable, SyncRejected, httpx.HTTPError):
            time.sleep(0.2)
    raise RuntimeError("no status within 120 s")


def _round_logs(store: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(store.rglob("rounds/*/*.json"))]


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="diloco bench attack", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"some of {', '.join(SCENARIOS)}")
    ap.add_argument("--rounds", type=int, default=40, help="bound: rounds")
    ap.add_argument("--ratio", type=float, default=9.0, help="bound: the adversary's norm / the honest one")
    ap.add_argument("--probe-every", type=int, default=5, help="bound: rounds between tries above the limit")
    ap.add_argument("--uploads", type=int, default=50, help="uploads: trickling uploads opened")
    ap.add_argument("--seconds", type=float, default=15.0, help="uploads, continuations: duration")
    ap.add_argument("--ids", type=int, default=200, help="sybil: new learner ids tried")
    ap.add_argument("--tries", type=int, default=20, help="claims: tries of each refused claim")
    ap.add_argument("--kills", type=int, default=10, help="continuations: kill -9 of the synchronizer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(list(argv))
    chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SCENARIOS))
    if unknown:
        print(f"diloco bench attack: unknown scenarios {unknown} (choose from {', '.join(SCENARIOS)})")
        return 2
    runs = {
        "bound": bound,
        "uploads": uploads,
        "sybil": sybil,
        "claims": claims,
        "continuations": continuations,
    }
    figures: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="diloco-bench-attack-") as d:
        for name in chosen:
            started = time.monotonic()
            figures[name] = runs[name](args, Path(d))
            figures[name]["seconds"] = round(time.monotonic() - started, 1)
            print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in figures[name].items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2, default=str))
    return 0
