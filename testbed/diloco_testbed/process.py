"""A server started as a plain child process, logging to a file, stopped by its own PID."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .prereq import unavailable
from .waiting import WaitTimeout, wait_for

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL the child if the thread that started it dies without tearing down.

    (A SIGTERM is not enough: kube-apiserver hangs in its graceful shutdown once etcd is gone.)
    Linux ties this to the starting *thread*, so it is only asked for from the main thread: a
    server started from a helper thread must not die when that thread ends.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class ManagedProcess:
    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> None:
        if self.running():
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== starting: {' '.join(self.argv)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.cwd,
                preexec_fn=_die_with_parent
                if threading.current_thread() is threading.main_thread()
                else None,
            )

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM this process (only it, by PID), then SIGKILL if it does not exit in time."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def failure_report(self) -> str:
        state = f"exited with code {self.returncode()}" if not self.running() else "still running"
        return f"{self.name} {state}; log {self.log_path}, last lines:\n{self.log_tail()}"


def stop_all(processes: Sequence[ManagedProcess]) -> None:
    """Stop processes in reverse start order."""
    for proc in reversed(processes):
        proc.stop()


def exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def await_started(
    proc: ManagedProcess, probe: Callable[[], Any], *, what: str, timeout: float, failure: str
) -> None:
    """Wait until ``probe()`` holds while ``proc`` runs; otherwise fail (or skip, see prereq) with
    ``failure``, the reason and the process's report."""

    def check() -> bool:
        if not proc.running():
            raise RuntimeError("the process exited")
        return bool(probe())

    try:
        wait_for(check, timeout=timeout, what=what, interval=0.5)
    except WaitTimeout as exc:
        unavailable(f"{failure}: {exc}\n{proc.failure_report()}")
