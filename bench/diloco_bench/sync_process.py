"""Real synchronizer processes for the benchmarks: started with the job's flags, waited for until
ready, killed with SIGKILL and started again on the same port and storage; and the sync-ingest
benchmark's shards, one process each, on a folder or a SeaweedFS bucket: their figures from
/metrics, and their restart after SIGKILL, timed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
from diloco_core.fragments import FragmentPlan

from diloco.runner.processes import free_port
from diloco_bench.proc_stats import peak_rss_bytes, summed
from diloco_bench.sync_ingest_report import Result

SECRET = "bench-secret"


def wait_ready(url: str, alive: Callable[[], bool], timeout_s: float) -> None:
    """Wait until the synchronizer at ``url`` answers ``/readyz`` with 200; RuntimeError when its
    process is gone (``alive`` false) or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("the synchronizer exited before it was ready")
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the synchronizer did not become ready in {timeout_s:.0f} s")


class BenchSync:
    """One synchronizer on 127.0.0.1 with file storage under ``store``; ``args``: its job flags."""

    def __init__(self, store: Path, args: Sequence[str], *, log: Path | None = None) -> None:
        self.store, self.args, self.log = store, list(args), log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> None:
        argv = [
            sys.executable, "-m", "diloco_sync", "--host", "127.0.0.1", "--port", str(self.port),
            "--storage", f"file://{self.store}", "--job-secret", SECRET, *self.args,
        ]  # fmt: skip
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115 (the process keeps it)
        proc = self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_ready(self.url, lambda: proc.poll() is None, timeout_s)
        except RuntimeError:
            self.stop()
            raise

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill9()


# -- the sync-ingest benchmark's synchronizers (one per shard) ------------------------------------


@contextmanager
def bench_storage(kind: str, root: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """The synchronizers' storage under ``root``, as (URL, environment for their processes):
    ``file``, a folder; ``seaweedfs``, a bucket on a real S3 server (SeaweedFS) started here and
    discarded at the end."""
    if kind == "file":
        yield f"file://{root / 'store'}", {}
        return
    from diloco_testbed.s3_server import S3Server  # boto3 and the weed binary: only when asked for

    (root / "s3").mkdir()
    server = S3Server(root / "s3")
    server.start()
    try:
        yield f"s3://{server.new_bucket('bench')}/job", server.env()
    finally:
        server.discard()


def start_sync(
    port: int,
    storage: str,
    plan: FragmentPlan,
    clients: int,
    shard: tuple[int, list[str]] = (0, []),
    flags: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """A synchronizer process on ``port`` with its storage at the URL ``storage``; ``shard``: its
    index and the URLs of all shards (none: the only one); ``flags``: more of its settings; ``env``:
    more of its environment (an S3 server's credentials)."""
    argv = [
        sys.executable, "-m", "diloco_sync", "--port", str(port), "--storage", storage,
        "--fragments", str(len(plan.fragments)), "--inner-steps", str(plan.inner_steps), "--overlap", "1",
        "--quorum", str(clients), "--max-staleness", "1000000", "--log-level", "WARNING",
    ]  # fmt: skip
    index, urls = shard
    if urls:
        argv += ["--shard-index", str(index), "--num-shards", str(len(urls)), "--shard-urls", ",".join(urls)]
    argv += flags
    environ = {**os.environ, **(env or {}), "DILOCO_JOB_SECRET": SECRET}
    proc = subprocess.Popen(argv, env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}", lambda: proc.poll() is None, 600)
    except RuntimeError:
        proc.kill()
        raise
    return proc


def start_shards(
    storage: str,
    plan: FragmentPlan,
    clients: int,
    shards: int,
    flags: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """``shards`` synchronizer processes sharing the storage (fragment p on shard p % shards), and
    their URLs."""
    ports = [free_port() for _ in range(shards)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, port in enumerate(ports):
            procs.append(
                start_sync(port, storage, plan, clients, (i, urls if shards > 1 else []), flags, env)
            )
    except BaseException:
        stop(procs)
        raise
    return procs, urls


def service_figures(urls: list[str]) -> dict[str, float]:
    """From the services' /metrics, each summed over the shards: the ``_sum`` and ``_count`` of
    the merge, commit and state read-back times and of the round participants; the bytes
    the contributions waiting for or in their rounds hold; the fragments' versions."""
    text = "\n".join(httpx.get(f"{url}/metrics", timeout=10).text for url in urls)
    names = [
        f"diloco_sync_{name}_{part}"
        for name in ("merge_seconds", "commit_seconds", "state_read_seconds", "round_participants")
        for part in ("sum", "count")
    ]
    out = {
        name: sum(float(found) for found in re.findall(rf"^{name} ([0-9.e+-]+)$", text, re.M))
        for name in names
    }
    held = re.findall(r"^diloco_sync_pending_bytes ([0-9.e+-]+)$", text, re.M)
    out["held"] = sum(float(found) for found in held)
    versions = re.findall(r"^diloco_sync_fragment_version\{[^}]*\} ([0-9.e+-]+)$", text, re.M)
    out["versions"] = sum(float(found) for found in versions)
    return out


def per_round(figures: dict[str, float], name: str) -> float:
    """The mean of histogram ``name`` (seconds per round; 0 when it has no sample)."""
    count = figures[f"diloco_sync_{name}_count"]
    return figures[f"diloco_sync_{name}_sum"] / count if count else 0.0


def timed_restart(
    procs: list[subprocess.Popen[bytes]],
    res: Result,
    seconds: float,
    start: Callable[[], tuple[list[subprocess.Popen[bytes]], list[str]]],
) -> list[subprocess.Popen[bytes]]:
    """Kill the synchronizers with SIGKILL wherever their rounds are, ``start`` them again on the
    same storage, and measure in ``res``: the seconds until every one is ready, then, for up to
    ``seconds`` or until no contribution waits for or is in a round, the rounds they run on the
    contributions read back, the fragments' versions they then serve, and their peak resident
    memory. Returns the new processes."""
    kill9(procs)
    t0 = time.perf_counter()
    procs, urls = start()
    res.restart_s = time.perf_counter() - t0
    deadline = time.perf_counter() + seconds
    while True:
        figures = service_figures(urls)
        if figures["held"] == 0 or time.perf_counter() >= deadline:
            break
        time.sleep(1.0)
    res.restart_rounds = int(figures["diloco_sync_merge_seconds_count"])
    res.restart_held = int(figures["held"])
    res.restart_versions = int(figures["versions"])
    res.restart_peak_rss = summed([peak_rss_bytes(proc.pid) for proc in procs])
    return procs


def kill9(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL every process and wait for it: nothing it held in memory only is kept."""
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.wait(timeout=30)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=30)
