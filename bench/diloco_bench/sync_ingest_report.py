"""What `diloco bench sync-ingest` measured in one run, and its table and JSON rows."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from diloco_core.fragments import FragmentPlan

from diloco_bench.proc_stats import cpu_seconds, cpu_times, peak_rss_bytes, summed


@dataclass
class Result:
    mode: str
    clients: int
    seconds: float
    contributions: int
    payload_bytes: int
    params_taken: int
    rounds: int
    contribute_ms: list[float] = field(default_factory=list, repr=False)
    round_trip_ms: list[float] = field(default_factory=list, repr=False)
    merge_s_per_round: float = 0.0
    merged: int = 0  # contributions the rounds merged
    raw_mb_s: float = 0.0
    versions_heard: int = 0
    model_params: int = 0
    sync_cpu_s: float | None = None  # the synchronizer process's CPU seconds during the run
    sync_system_s: float | None = None  # the part of them the kernel spent (system time)
    sync_peak_rss: int | None = None  # its peak resident bytes (from its start), all shards together
    shards: int = 1  # synchronizer processes
    largest_shard_rss: int | None = None  # the peak resident bytes of the largest shard
    waits: int = 0  # parts answered pending_full (the pending budget was full) and sent again
    storage: str = "file"  # the synchronizers' storage: file or seaweedfs
    downloads: str = "updates"  # how the long-polls asked for new versions: updates, or whole
    heard_bytes: int = 0  # the bytes of the new versions the long-polls received
    storage_cpu_s: float | None = None  # the S3 server's CPU seconds during the run (None on a folder)
    storage_peak_rss: int | None = None  # its peak resident bytes
    commit_s_per_round: float = 0.0  # making a round durable (its objects and the manifest)
    state_read_s_per_round: float = 0.0  # reading a fragment's state back for a round (0: held in memory)
    versions: int = 0  # the fragments' versions summed, at the end of the run
    restart_s: float | None = None  # from SIGKILL until every synchronizer started again is ready
    restart_rounds: int | None = None  # rounds the restarted synchronizers ran on what they read back
    restart_held: int | None = None  # bytes the contributions waiting or in rounds still held then
    restart_versions: int | None = None  # the fragments' versions summed, then
    restart_peak_rss: int | None = None  # their peak resident bytes, all shards together

    @property
    def mb_s(self) -> float:
        return self.payload_bytes / self.seconds / 1e6

    @property
    def params_s(self) -> float:
        return self.params_taken / self.seconds

    @property
    def rounds_s(self) -> float:
        return self.rounds / self.seconds if self.seconds else 0.0


def per_round(figures: dict[str, float], name: str) -> float:
    """The mean of histogram ``name`` (seconds per round; 0 when it has no sample)."""
    count = figures[f"{name}_count"]
    return figures[f"{name}_sum"] / count if count else 0.0


@dataclass(frozen=True)
class CpuMark:
    """The synchronizers' CPU seconds, all and the kernel's, and the S3 server's, at one moment."""

    sync: float | None
    sync_system: float | None
    server: float | None

    @classmethod
    def now(cls, pids: list[int], server: int | None) -> CpuMark:
        """``server``: the S3 server's process, None on a folder."""
        times = [cpu_times(pid) for pid in pids]  # each process read once for both figures
        return cls(
            summed([t and t.total for t in times]),
            summed([t and t.system for t in times]),
            cpu_seconds(server) if server else None,
        )


def record_processes(res: Result, pids: list[int], before: CpuMark, server: int | None) -> None:
    """Into ``res``: the synchronizers' CPU seconds since ``before`` and peak memory, and the S3
    server's (``server``: its process, None on a folder), whose work for the synchronizers is
    not in theirs."""
    after = CpuMark.now(pids, server)
    if before.sync is not None and after.sync is not None:
        res.sync_cpu_s = after.sync - before.sync
    if before.sync_system is not None and after.sync_system is not None:
        res.sync_system_s = after.sync_system - before.sync_system
    peaks = [peak_rss_bytes(pid) for pid in pids]
    res.sync_peak_rss = summed(peaks)
    res.largest_shard_rss = max((n for n in peaks if n is not None), default=None)
    if server is not None and before.server is not None and after.server is not None:
        res.storage_cpu_s = after.server - before.server
        res.storage_peak_rss = peak_rss_bytes(server)


def record_rounds(res: Result, figures: dict[str, float], plan: FragmentPlan) -> None:
    """Into ``res``: the rounds and what they merged, the time per round, the parameters taken."""
    res.rounds = int(figures["merge_seconds_count"])
    res.merged = int(figures["round_participants_sum"])
    res.versions = int(figures["versions"])
    res.merge_s_per_round = per_round(figures, "merge_seconds")
    res.commit_s_per_round = per_round(figures, "commit_seconds")
    res.state_read_s_per_round = per_round(figures, "state_read_seconds")
    res.params_taken = res.contributions * (plan.num_params // len(plan.fragments))


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def report(results: list[Result], plan: FragmentPlan, payload_bytes: int) -> str:
    """Two tables at one model size (``payload_bytes``: one fragment's contribution): a row per run
    with its ingest, rounds, CPU and memory; then, a row per run beginning with its storage, the
    commit and state read-back times, the S3 server's CPU and memory, and the restart."""
    lines = [
        f"mode: {results[0].mode if results else '-'}; "
        f"model: {plan.num_params:,} parameters in {len(plan.fragments)} fragments; payload int4 "
        f"({payload_bytes:,} bytes per fragment contribution)",
        f"{'clients':>7} {'shards':>6} {'MB/s':>8} {'Mparams/s':>10} {'raw MB/s':>9} {'svc/raw':>8} {'post p50':>9} {'p90':>7} "
        f"{'p99':>7} {'round p50':>10} {'p99':>7} {'rounds':>7} {'rounds/s':>8} {'merged':>7} {'merge ms/round':>15} "
        f"{'Mparams/cpu-s':>13} {'peak RSS MB':>11} {'RSS/fp32':>8} {'waits':>6} {'storage':>9}",
    ]
    for r in results:
        ratio = r.mb_s / r.raw_mb_s if r.raw_mb_s else float("nan")
        lines.append(
            f"{r.clients:>7} {r.shards:>6} {r.mb_s:>8.2f} {r.params_s / 1e6:>10.2f} {r.raw_mb_s:>9.2f} {ratio:>8.3f} "
            f"{percentile(r.contribute_ms, 50):>8.1f}ms {percentile(r.contribute_ms, 90):>6.1f} "
            f"{percentile(r.contribute_ms, 99):>7.1f} {percentile(r.round_trip_ms, 50):>9.1f}ms "
            f"{percentile(r.round_trip_ms, 99):>7.1f} {r.rounds:>7} {r.rounds_s:>8.3f} {r.merged:>7} {1000 * r.merge_s_per_round:>15.2f} "
            f"{_per_cpu(r):>13} {_mb(r.sync_peak_rss):>11} {_rss_ratio(r):>8} {r.waits:>6} {r.storage:>9}"
        )
    lines += [
        "",
        f"{'storage':>9} {'clients':>7} {'shards':>6} {'commit ms/round':>15} {'state read ms/round':>19} "
        f"{'sync CPU-s':>10} {'kernel':>6} {'storage CPU-s':>13} {'storage peak RSS MB':>19} "
        f"{'restart s':>9} {'rounds after':>12} {'held MB left':>12} {'restart peak RSS MB':>19}",
    ]
    for r in results:
        lines.append(
            f"{r.storage:>9} {r.clients:>7} {r.shards:>6} {1000 * r.commit_s_per_round:>15.1f} "
            f"{1000 * r.state_read_s_per_round:>19.1f} {_opt(r.sync_cpu_s, '.1f'):>10} {_kernel_share(r):>6} "
            f"{_opt(r.storage_cpu_s, '.1f'):>13} "
            f"{_mb(r.storage_peak_rss):>19} {_opt(r.restart_s, '.1f'):>9} "
            f"{_opt(r.restart_rounds, 'd'):>12} {_mb(r.restart_held):>12} "
            f"{_mb(r.restart_peak_rss):>19}"
        )
    return "\n".join(lines)


def _opt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def per_cpu_second(r: Result) -> float | None:
    """Parameters taken per CPU second of the synchronizer process (all its threads)."""
    return r.params_taken / r.sync_cpu_s if r.sync_cpu_s else None


def rss_over_model(r: Result) -> float | None:
    """The synchronizer's peak resident memory over the model's fp32 size."""
    return r.sync_peak_rss / (4 * r.model_params) if r.sync_peak_rss and r.model_params else None


def _per_cpu(r: Result) -> str:
    v = per_cpu_second(r)
    return "-" if v is None else f"{v / 1e6:.1f}"


def _kernel_share(r: Result) -> str:
    """The kernel's share of the synchronizers' CPU seconds (system time: page faults, file I/O)."""
    if r.sync_system_s is None or not r.sync_cpu_s:
        return "-"
    return f"{100 * r.sync_system_s / r.sync_cpu_s:.0f}%"


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.0f}"


def _rss_ratio(r: Result) -> str:
    v = rss_over_model(r)
    return "-" if v is None else f"{v:.1f}x"


def summary_row(r: Result) -> dict[str, Any]:
    """One run's figures for ``--json`` (the latency lists as percentiles)."""
    d = asdict(r)
    d.update(
        mb_s=r.mb_s,
        params_s=r.params_s,
        params_per_cpu_s=per_cpu_second(r),
        rounds_s=r.rounds_s,
        rss_over_fp32_model=rss_over_model(r),
        contribute_p50_ms=percentile(r.contribute_ms, 50),
        contribute_p99_ms=percentile(r.contribute_ms, 99),
        round_p50_ms=percentile(r.round_trip_ms, 50),
        round_p99_ms=percentile(r.round_trip_ms, 99),
        median_contribute_ms=statistics.median(r.contribute_ms) if r.contribute_ms else None,
    )
    del d["contribute_ms"], d["round_trip_ms"]
    return d


def scale_lines(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The runs as the scale plot's lines: one per storage, client count, shard count and mode (a
    row written before the storage was recorded ran on a folder)."""
    lines: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        storage = row.get("storage", "file")
        label = f"{storage}, {row['clients']} clients, {row.get('shards', 1)} shard(s), {row['mode']}"
        lines.setdefault(label, []).append({**row, "params": row["model_params"]})
    return lines
