"""`diloco bench attack`: what one learner with a valid token can do to a job, against a real
synchronizer process (file storage), driven through the learner's own client
(``diloco_worker.sync_client``). Each scenario prints its figures:

- ``bound``: an honest learner sends outer gradients of norm 1 each round; an adversarial one, with
  the most tokens per step it may claim (so the largest merge weight), sends just inside the norm
  limit every round (``--ratio`` times the honest norm), tries a little above it every
  ``--probe-every`` rounds, and, after a kill -9 of the synchronizer halfway, five times the
  parameters' norm. Figures: rounds, the largest movement of the global model in a round against
  the bound (``max_update_norm_factor`` x the honest norm with outer lr 1, no momentum, no warm-up,
  whole fp32 versions down), the adversary's contributions merged and those merged scaled down to
  the limit (clipped), and whether the limit grew; then the same run with int2 downloads (the default), whose figure is the largest
  movement of what a learner receives (the version plus its download residual).
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
- ``capture``: what an eavesdropper on a learner's link can do with the requests it reads
  (``--tries`` times each): send a request again as it was, its proof on the learner's ``leave``
  route or with more steps, its proof a window later, the learner's whole token as a bearer.
  Figures: how many of each were refused, and that the learner is still served.
- ``continuations``: a learner sends its progress in parts (``since``), the synchronizer is killed
  with kill -9 at random moments (``--kills``) and the learner resends what was not answered, in
  order. Figures: parts acknowledged, steps acknowledged and steps merged (each step once), parts
  refused ``out_of_order`` and taken after their predecessors.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from diloco_bench.attack_capture import capture
from diloco_bench.attack_continuations import continuations
from diloco_bench.attack_scenarios import bound, claims, sybil, uploads

SCENARIOS = ("bound", "uploads", "sybil", "claims", "capture", "continuations")


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
    ap.add_argument(
        "--tries", type=int, default=20, help="claims, capture: tries of each refused claim or replay"
    )
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
        "capture": capture,
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
