"""Real synchronizer processes for the benchmarks: started with the job's flags, waited for until
ready, killed with SIGKILL and started again on the same port and storage; and the sync-ingest
benchmark's shards, one process each, on a folder or a SeaweedFS bucket: their figures from
/metrics, and their restart after SIGKILL, timed."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
from diloco_core.fragments import FragmentPlan
from prometheus_client.parser import text_string_to_metric_families

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
        if self.proc is not None:
            kill9([self.proc], timeout_s=10)

    def stop(self) -> None:
        if self.proc is not None:
            stop([self.proc], timeout_s=10)


# -- the sync-ingest benchmark's synchronizers (one per shard) ------------------------------------


@dataclass(frozen=True)
class Storage:
    """The synchronizers' storage: its URL, what their processes need in their environment, and
    the process of the S3 server behind it (None for a folder)."""

    url: str
    env: dict[str, str]
    server_pid: int | None = None


def storage_problem(kinds: Sequence[str]) -> str | None:
    """Why the storage kinds asked for cannot be had here (None: they can): SeaweedFS needs its
    ``weed`` binary, which the project's dev dependencies bring."""
    if "seaweedfs" not in kinds:
        return None
    from diloco_testbed.prereq import find_tool
    from diloco_testbed.s3_server import WEED_HINT  # boto3: only when asked for

    if find_tool("weed") is None:
        return f"--storage seaweedfs needs SeaweedFS's 'weed' binary, not found: {WEED_HINT}"
    return None


@contextmanager
def bench_storage(kind: str, root: Path) -> Iterator[Storage]:
    """The synchronizers' storage under ``root``: ``file``, a folder; ``seaweedfs``, a bucket on a
    real S3 server (SeaweedFS) started here and discarded at the end."""
    if kind == "file":
        yield Storage(f"file://{root / 'store'}", {})
        return
    from diloco_testbed.s3_server import S3Server  # boto3 and the weed binary: only when asked for

    (root / "s3").mkdir()
    server = S3Server(root / "s3")
    try:
        server.start()
        yield Storage(f"s3://{server.new_bucket('bench')}/job", server.env(), server.pid)
    finally:
        server.discard()


SYNC_FLAGS = ("--pending-memory-bytes", "--served-in-memory-bytes")  # the bench passes them on


def sync_flags(given: argparse.Namespace) -> list[str]:
    """The synchronizers' settings given on the bench's command line (``SYNC_FLAGS``), as flags."""
    flags = []
    for flag in SYNC_FLAGS:
        if (value := getattr(given, flag[2:].replace("-", "_"))) is not None:
            flags += [flag, str(value)]
    return flags


def spawn_sync(
    port: int,
    storage: Storage,
    plan: FragmentPlan,
    clients: int,
    shard: tuple[int, list[str]] = (0, []),
    flags: Sequence[str] = (),
) -> tuple[subprocess.Popen[bytes], LastWords]:
    """A synchronizer process on ``port`` on ``storage`` (not waited for), and the last of what it
    writes to its standard error; ``shard``: its index and the URLs of all shards (none: the only
    one); ``flags``: more of its settings."""
    argv = [
        sys.executable, "-m", "diloco_sync", "--port", str(port), "--storage", storage.url,
        "--fragments", str(len(plan.fragments)), "--inner-steps", str(plan.inner_steps), "--overlap", "1",
        "--quorum", str(clients), "--max-staleness", "1000000", "--log-level", "WARNING",
    ]  # fmt: skip
    index, urls = shard
    if urls:
        argv += ["--shard-index", str(index), "--num-shards", str(len(urls)), "--shard-urls", ",".join(urls)]
    argv += flags
    env = {**os.environ, **storage.env, "DILOCO_JOB_SECRET": SECRET}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    return proc, LastWords(proc.stderr)


class LastWords:
    """The last ``limit`` bytes a process writes to a pipe, read as they come by a thread of their
    own: the pipe never fills, and nothing beyond them is kept, in memory or on disk, however long
    the process runs."""

    def __init__(self, pipe: IO[bytes], limit: int = 4000) -> None:
        self._kept = bytearray()
        self._limit = limit
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._drain, args=(pipe,), daemon=True)
        self._reader.start()

    def _drain(self, pipe: IO[bytes]) -> None:
        with pipe:
            while chunk := os.read(pipe.fileno(), 1 << 16):
                with self._lock:
                    self._kept += chunk
                    del self._kept[: max(0, len(self._kept) - self._limit)]

    def text(self, wait_s: float = 2.0) -> str:
        """What was kept, once the pipe is closed (at most ``wait_s`` to read what is left in it)."""
        self._reader.join(wait_s)
        with self._lock:
            return bytes(self._kept).decode(errors="replace").strip()


def _why_exited(proc: subprocess.Popen[bytes], said: LastWords) -> str:
    """What a synchronizer that exited wrote last to its standard error (its refusal of a flag, a
    traceback), or that it is still running."""
    if proc.poll() is None:
        return "it is still running"
    words = said.text()
    return f"it exited with status {proc.returncode}" + (f"; its last words:\n{words}" if words else "")


def start_shards(
    storage: Storage,
    plan: FragmentPlan,
    clients: int,
    shards: int,
    flags: Sequence[str] = (),
    ready_timeout_s: float = 60.0,
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """``shards`` synchronizer processes sharing the storage (fragment p on shard p % shards), all
    started at once, then waited for until each is ready; and their URLs."""
    ports = [free_port() for _ in range(shards)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    procs: list[subprocess.Popen[bytes]] = []
    said: list[LastWords] = []  # each read only when its synchronizer does not get ready
    try:
        for i, port in enumerate(ports):
            proc, words = spawn_sync(port, storage, plan, clients, (i, urls if shards > 1 else []), flags)
            procs.append(proc)
            said.append(words)
        for proc, url, words in zip(procs, urls, said, strict=True):
            try:
                wait_ready(url, lambda proc=proc: proc.poll() is None, ready_timeout_s)  # type: ignore[misc]
            except RuntimeError as exc:
                raise RuntimeError(f"{exc} ({url}): {_why_exited(proc, words)}") from exc
    except BaseException:
        stop(procs)
        raise
    return procs, urls


# the figures read from the services' /metrics: sample name -> key
FIGURES = {
    **{
        f"diloco_sync_{name}_{part}": f"{name}_{part}"
        for name in ("merge_seconds", "commit_seconds", "state_read_seconds", "round_participants")
        for part in ("sum", "count")
    },
    "diloco_sync_pending_bytes": "held",  # the contributions waiting for or in their rounds
    "diloco_sync_fragment_version": "versions",  # summed over the fragments
}


def parse_figures(texts: Sequence[str]) -> dict[str, float]:
    """``FIGURES`` from the services' /metrics texts, each summed over the services (and, for the
    fragments' versions, over the fragments). ``ValueError`` when one is missing: a figure read as 0
    would end a watch or a count early."""
    out = dict.fromkeys(FIGURES.values(), 0.0)
    seen = set()
    for text in texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if (key := FIGURES.get(sample.name)) is not None:
                    out[key] += sample.value
                    seen.add(key)
    if missing := sorted(set(FIGURES.values()) - seen):
        raise ValueError(f"the services' metrics lack {missing}")
    return out


def service_figures(urls: list[str]) -> dict[str, float]:
    """``parse_figures`` of the services' /metrics now."""
    return parse_figures([httpx.get(f"{url}/metrics", timeout=10).text for url in urls])


RESTART_WATCH_MIN_S = 60.0  # a restart's rounds on what it read back are waited for this long at least


def timed_restart(
    procs: list[subprocess.Popen[bytes]],
    res: Result,
    seconds: float,
    start: Callable[[], tuple[list[subprocess.Popen[bytes]], list[str]]],
) -> list[subprocess.Popen[bytes]]:
    """Kill the synchronizers with SIGKILL wherever their rounds are, ``start`` them again on the
    same storage, and measure in ``res``: the seconds until every one is ready, then, once no
    contribution waits for or is in a round, or at the latest after the longer of ``seconds`` and
    ``RESTART_WATCH_MIN_S``, the rounds they ran on the contributions read back, the fragments'
    versions they then serve, and their peak resident memory. Returns the new processes (stopped
    here when the watch fails)."""
    kill9(procs)
    t0 = time.perf_counter()
    procs, urls = start()
    try:
        res.restart_s = time.perf_counter() - t0
        deadline = time.perf_counter() + max(seconds, RESTART_WATCH_MIN_S)
        while (figures := service_figures(urls))["held"] > 0 and time.perf_counter() < deadline:
            time.sleep(1.0)
        res.restart_rounds = int(figures["merge_seconds_count"])
        res.restart_held = int(figures["held"])
        res.restart_versions = int(figures["versions"])
        res.restart_peak_rss = summed([peak_rss_bytes(proc.pid) for proc in procs])
    except BaseException:
        stop(procs)
        raise
    return procs


def kill9(procs: list[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> None:
    """SIGKILL every process and wait for it: nothing it held in memory only is kept."""
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
    for proc in procs:
        proc.wait(timeout=timeout_s)


def stop(procs: list[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> None:
    """SIGTERM every process; one still running ``timeout_s`` later is killed."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill9([proc], timeout_s)
