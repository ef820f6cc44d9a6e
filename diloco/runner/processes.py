"""Child processes of a run: launch with a log file, kill, and stop cleanly (thin I/O)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Child:
    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL: the learner dies without any chance to say goodbye (a failure)."""
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM: the learner leaves cleanly."""
        self._signal(signal.SIGTERM)

    def _signal(self, sig: signal.Signals) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, sig)

    def log_tail(self, max_chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-max_chars:]
        except OSError:
            return ""


def launch(name: str, argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None) -> Child:
    """Start ``argv`` with stdout and stderr appended to ``log_path``.

    The child runs in its own session so a Ctrl-C in the terminal reaches only the runner, which then
    stops every child in order; if the runner itself dies (SIGKILL, the OOM killer), the kernel kills
    the child too (Linux), so no synchronizer or learner outlives its run to write into the run folder
    beside a resumed one.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        log.write(f"\n=== {time.strftime('%H:%M:%S')} launch: {' '.join(argv)}\n".encode())
        log.flush()
        popen = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
            start_new_session=True,
            preexec_fn=die_with_parent(os.getpid()) if sys.platform.startswith("linux") else None,
        )
    return Child(name, list(argv), popen, log_path)


PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> Callable[[], None]:
    """In the child, before it runs: SIGKILL when the parent process dies, and at once if it already has."""

    def arm() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGKILL)

    return arm


def stop_all(children: Sequence[Child], timeout_s: float) -> dict[str, int | None]:
    """SIGTERM every live child, wait up to ``timeout_s`` for all of them, then SIGKILL the rest.

    Returns each child's exit code (negative: killed by that signal)."""
    for child in children:
        child.terminate()
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.popen.wait(timeout=10)
    return {child.name: child.exit_code() for child in children}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port
