"""One round in a worker thread: the round's mathematics with its checks (``diloco_core.screening``
around ``diloco_core.round_math``), then the blobs the commit writes. This module adds only the
encoding, the timing and the durable round record.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from diloco_core import codec, stored_frame
from diloco_core.config import DiLoCoSettings
from diloco_core.fragments import Fragment
from diloco_core.outer import OuterState
from diloco_core.protocol import RoundRecord
from diloco_core.round_math import RoundResult
from diloco_core.screening import NormHistory, screened_round

from .contribution import Arrays, Contribution

NO_HISTORY = NormHistory()


@dataclass(frozen=True)
class RoundOutcome:
    """A merged round, encoded for its commit. ``result`` without its update (which is as large as
    the fragment and needed only for its norm, ``result.update_norm``), so that a round waiting for
    its commit holds no more of it than it writes and publishes; its outer state is written to
    storage from ``result.outer`` by the commit (``write_outer_state``), and so is the new version of
    a fragment served from storage (``write_version``: never held whole, nor joined from pieces)."""

    result: RoundResult
    payload: bytes | None  # the new version as served; None: written by the commit (``write_version``)
    merge_s: float
    merged: tuple[Contribution, ...] = ()  # in the order of ``result.weights``
    excluded: tuple[tuple[Contribution, str], ...] = ()  # left out by the checks, with the reason
    norms: NormHistory = NO_HISTORY  # the fragment's norm history after this round
    clipped: tuple[tuple[Contribution, str], ...] = ()  # merged scaled down to their limit, with the reason
    update_clipped: str | None = None  # why the merged update was scaled down, when it was


@dataclass(frozen=True)
class NothingMerged:
    """Every contribution of the round failed the checks: nothing to commit."""

    excluded: tuple[tuple[Contribution, str], ...]


def write_outer_state(sink: codec.Sink, state: OuterState, fragment: int, version: int) -> int:
    """The outer optimizer's state for storage only, written into ``sink`` (an upload of its object)
    piece by piece: fp32 (lossless) in a stored zstd frame (``stored_frame``), as fp32 momentum and
    download residuals do not compress and this object is written every round. Nothing of its size is
    held while it is written; its size."""
    return codec.encode_into(
        sink,
        state.to_arrays(),
        fragment=fragment,
        base_version=version,
        kind="params",
        quantizer="fp32",
        level=stored_frame.STORED,
    )


def write_version(sink: codec.Sink, params: Arrays, fragment: int, version: int) -> int:
    """A new version as it is served and stored (``codec.encode_params``), written into ``sink`` (an
    upload of its object) as it is encoded; its size."""
    return codec.encode_params_into(sink, params, fragment, version)


def run_round(
    spec: Fragment,
    params: Arrays,
    outer: OuterState,
    version: int,
    contributions: Sequence[Contribution],
    diloco: DiLoCoSettings,
    norms: NormHistory = NO_HISTORY,
    encode_version: bool = True,
) -> RoundOutcome | NothingMerged:
    """Merge the contributions that pass the checks into a new version of the fragment, encoded for
    the commit (without ``encode_version``, the commit encodes it as it writes it); never raises on a
    contribution's values (those that fail are excluded, those above the norm limit clipped)."""
    started = time.perf_counter()
    screened = screened_round(spec, params, outer, version, contributions, diloco, norms)
    if screened.result is None:
        return NothingMerged(screened.excluded)
    result = replace(screened.result, update={})
    screened = replace(screened, result=result)  # the update is no longer held while encoding
    payload = codec.encode_params(result.params, spec.index, result.version) if encode_version else None
    return RoundOutcome(
        result,
        payload,
        merge_s=time.perf_counter() - started,
        merged=screened.merged,
        excluded=screened.excluded,
        norms=screened.next_history(),
        clipped=screened.clipped,
        update_clipped=screened.update_clipped,
    )


def recent_round_keys(versions: dict[int, int], n: int) -> list[tuple[int, int]]:
    """The ``(fragment, version)`` round logs that hold the ``n`` newest rounds across fragments:
    the newest ``n`` versions of each fragment (the newest rounds overall are among them)."""
    return [(p, v) for p, newest in sorted(versions.items()) for v in range(newest, max(0, newest - n), -1)]


def round_scalars(entry: dict[str, Any]) -> dict[str, float]:
    """A round log's figures for experiment tracking, under ``fragment_<p>/`` (their step is the version)."""
    base = entry["version"] - 1  # the version the round was merged onto
    lags = [base - b for b in entry["base_versions"]]
    figures = {
        "participants": len(entry["participants"]),
        "merged_steps": sum(entry["steps"]),
        "merged_tokens": sum(entry["tokens"]),
        "excluded": len(entry["excluded"]),
        "clipped": len(entry.get("clipped", ())),
        "staleness_mean": sum(lags) / len(lags) if lags else 0.0,
        "update_norm": entry["update_norm"],
        "merge_s": entry["merge_s"],
        **{k: entry[k] for k in ("quorum_wait_s", "grace_s") if k in entry},
    }
    return {f"fragment_{entry['fragment']}/{k}": float(v) for k, v in figures.items()}


def round_record(entry: dict[str, Any]) -> RoundRecord:
    """What the status shows of a round, from its round log (``round_log``); a field the log predates
    takes its default. ``ValueError`` for an entry that does not parse."""
    return RoundRecord.model_validate(
        {field: entry[field] for field in RoundRecord.model_fields if field in entry}
    )


def rounds_from_logs(entries: Sequence[dict[str, Any]], n: int) -> list[RoundRecord]:
    """The ``n`` newest rounds of these round logs, oldest first (entries that do not parse are skipped)."""
    rounds: list[RoundRecord] = []
    for entry in entries:
        try:
            rounds.append(round_record(entry))
        except ValueError:
            continue
    rounds.sort(key=lambda r: (r.finished_at, r.fragment, r.version))
    return rounds[-n:]


def _with_reasons(contributions: Sequence[tuple[Contribution, str]]) -> list[dict[str, str]]:
    return [{"learner": c.learner_id, "key": c.key, "reason": reason} for c, reason in contributions]


def round_log(
    fragment: int, outcome: RoundOutcome, contributions: Sequence[Contribution], timing: dict[str, float]
) -> dict[str, Any]:
    """The durable round record (the event tape): who was merged, with which weights and base versions."""
    return {
        "fragment": fragment,
        "version": outcome.result.version,
        "participants": [c.learner_id for c in contributions],
        "weights": list(outcome.result.weights),
        "base_versions": [c.base_version for c in contributions],
        "keys": [c.key for c in contributions],
        "merged_keys": [
            part.key for c in contributions for part in c.received()
        ],  # with those added into them
        "steps": [c.steps for c in contributions],
        "tokens": [c.tokens for c in contributions],
        "excluded": _with_reasons(outcome.excluded),
        "clipped": _with_reasons(outcome.clipped),
        **({"update_clipped": outcome.update_clipped} if outcome.update_clipped else {}),
        "finished_at": time.time(),
        "merge_s": outcome.merge_s,
        "update_norm": outcome.result.update_norm,
        **timing,
    }
