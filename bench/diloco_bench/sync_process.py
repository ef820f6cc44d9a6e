"""Real synchronizer processes for the benchmarks: started with the job's flags, waited for until
ready, killed with SIGKILL and started again on the same port and storage; and the sync-ingest
benchmark's shards, one process each."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
from diloco_core.fragments import FragmentPlan

from diloco.runner.processes import free_port

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


def start_sync(
    port: int,
    store: str,
    plan: FragmentPlan,
    clients: int,
    shard: tuple[int, list[str]] = (0, []),
    flags: Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    """A synchronizer process on ``port``; ``shard``: its index and the URLs of all shards (none:
    the only one); ``flags``: more of its settings."""
    argv = [
        sys.executable, "-m", "diloco_sync", "--port", str(port), "--storage", f"file://{store}",
        "--fragments", str(len(plan.fragments)), "--inner-steps", str(plan.inner_steps), "--overlap", "1",
        "--quorum", str(clients), "--max-staleness", "1000000", "--log-level", "WARNING",
    ]  # fmt: skip
    index, urls = shard
    if urls:
        argv += ["--shard-index", str(index), "--num-shards", str(len(urls)), "--shard-urls", ",".join(urls)]
    argv += flags
    env = {**os.environ, "DILOCO_JOB_SECRET": SECRET}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{port}", lambda: proc.poll() is None, 60)
    except RuntimeError:
        proc.kill()
        raise
    return proc


def start_shards(
    store: str, plan: FragmentPlan, clients: int, shards: int, flags: Sequence[str] = ()
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """``shards`` synchronizer processes sharing the store (fragment p on shard p % shards), and
    their URLs."""
    ports = [free_port() for _ in range(shards)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, port in enumerate(ports):
            procs.append(start_sync(port, store, plan, clients, (i, urls if shards > 1 else []), flags))
    except BaseException:
        stop(procs)
        raise
    return procs, urls


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(timeout=30)
