"""A synchronizer started as a real process, and a small learner-side client for the tests."""

from __future__ import annotations

import os
import signal
import ssl
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from diloco_core import codec, downlink
from diloco_core.auth import learner_token
from diloco_core.fragments import FragmentPlan, build_plan
from diloco_core.protocol import LEARNER_HEADER, VERSION_HEADER
from diloco_core.request_proof import ProofAuth, prove
from diloco_testbed.ports import free_port
from diloco_testbed.process import ManagedProcess
from diloco_testbed.waiting import wait_for

SECRET = "test-job-secret"
SHAPES: list[tuple[str, list[int]]] = [
    ("wte.weight", [16, 8]),
    ("h.0.attn.weight", [8, 8]),
    ("h.0.mlp.weight", [8, 16]),
    ("h.1.attn.weight", [8, 8]),
    ("h.1.mlp.weight", [8, 16]),
]


def tiny_plan(fragments: int = 2, inner_steps: int = 4, overlap: int = 1) -> FragmentPlan:
    return build_plan(SHAPES, fragments, inner_steps, overlap, embedding_names=("wte.weight",))


def initial_params(plan: FragmentPlan, p: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + 1000 * p)
    return {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in plan.fragments[p].tensors}


def outer_grad(plan: FragmentPlan, p: int, seed: int, scale: float = 0.01) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        t.name: (scale * rng.standard_normal(t.shape)).astype(np.float32) for t in plan.fragments[p].tensors
    }


def encode_grad(tensors: Mapping[str, np.ndarray], p: int, base: int, quantizer: str = "fp32") -> bytes:
    return codec.encode(tensors, fragment=p, base_version=base, kind="outer_grad", quantizer=quantizer)


def encode_params(tensors: Mapping[str, np.ndarray], p: int) -> bytes:
    return codec.encode(tensors, fragment=p, base_version=0, kind="params", quantizer="fp32")


def learner_auth(learner_id: str, token_of: str | None = None, **claims: float) -> dict[str, Any]:
    """httpx request arguments of ``learner_id`` (its header, and each request signed) with the token
    of ``token_of`` (itself by default) carrying ``claims`` (``diloco_core.auth.learner_token``'s:
    expires_at, generation, tokens_per_step, min_step_s, issued_at)."""
    token = learner_token(SECRET, token_of or learner_id, **claims)
    return {"headers": {LEARNER_HEADER: learner_id}, "auth": ProofAuth(token)}


def signed_head_lines(learner_id: str, method: str, target: str, instance: str) -> str:
    """The head lines of one request of ``learner_id`` to ``target`` (path and query) at the
    synchronizer process ``instance`` (``instance_at``), for a raw socket."""
    proof = prove(learner_token(SECRET, learner_id), method, target, instance=instance)
    return f"Authorization: {proof}\r\n{LEARNER_HEADER}: {learner_id}\r\n"


# runs ``python -m diloco_sync ARGS`` with a lower limit of open files (argv[1] is the module name)
_WITH_FD_LIMIT = (
    "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit})); "
    "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)


class SyncProcess:
    """``python -m diloco_sync`` on a fixed free port; restartable with the same storage."""

    def __init__(
        self,
        log_dir: Path,
        storage_url: str,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        port: int | None = None,
        tls_ca: Path | None = None,
        inherit: Callable[[str], bool] = lambda _name: True,
        fd_limit: int | None = None,
    ):
        """``inherit(name)``: whether this test's environment variable ``name`` is passed on;
        ``fd_limit``: the process's limit of open files (RLIMIT_NOFILE), when given."""
        self.port = port or free_port()
        self.verify: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=str(tls_ca)) if tls_ca else True
        )
        self.url = f"{'https' if tls_ca else 'http'}://127.0.0.1:{self.port}"
        launcher = ["-m"] if fd_limit is None else ["-c", _WITH_FD_LIMIT.format(limit=fd_limit)]
        argv = [
            sys.executable,
            *launcher,
            "diloco_sync",
            "--port",
            str(self.port),
            "--storage",
            storage_url,
            *args,
        ]
        inherited = {k: v for k, v in os.environ.items() if inherit(k)}
        full_env = {**inherited, "DILOCO_JOB_SECRET": SECRET, **(env or {})}
        self.log_path = log_dir / f"sync-{self.port}.log"
        self.process = ManagedProcess("synchronizer", argv, self.log_path, env=full_env)

    def start(self, *, wait_loaded: bool = True) -> None:
        """Start the process and wait until it answers ``/healthz`` and, with ``wait_loaded``, until
        it has loaded its state (before that, every /v1 route answers 503 ``starting``)."""
        self.process.start()
        wait_for(self._healthy, timeout=60, what=f"synchronizer at {self.url}", interval=0.1)
        if wait_loaded:
            wait_for(self._loaded, timeout=60, what=f"synchronizer at {self.url} to load its state")

    def _healthy(self) -> bool:
        if not self.process.running():
            raise RuntimeError(self.process.failure_report())
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1, verify=self.verify).status_code == 200
        except httpx.HTTPError:
            return False

    def _loaded(self) -> bool:
        if not self.process.running():
            raise RuntimeError(self.process.failure_report())
        try:
            return httpx.get(f"{self.url}/readyz", timeout=1, verify=self.verify).json()["loaded"] is True
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    def kill9(self) -> None:
        """SIGKILL, by this process's own PID: no shutdown code runs."""
        pid = self.process.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not self.process.running(), timeout=10, what="synchronizer to die", interval=0.01)

    def stop(self) -> None:
        """SIGTERM: the synchronizer shuts down cleanly (then SIGKILL if it does not)."""
        self.process.stop()

    def discard(self) -> None:
        """At the end of a test: SIGKILL when still running, since nothing reads what a clean
        shutdown would leave (tests that stop it cleanly call ``stop()`` themselves)."""
        if self.process.running():
            self.kill9()


class Learner:
    """The learner side of the protocol, just enough to drive the synchronizer."""

    def __init__(
        self,
        base_url: str,
        learner_id: str,
        plan: FragmentPlan,
        tokens_per_step: int = 8,
        claims: Mapping[str, float] | None = None,
    ):
        """``claims``: of the learner's token (``learner_auth``)."""
        self.id = learner_id
        self.plan = plan
        self.tokens_per_step = tokens_per_step
        self.client = httpx.Client(
            base_url=base_url, timeout=30, **learner_auth(learner_id, **(claims or {}))
        )
        self.seq = 0
        self.updates = 0  # versions that came as updates (compressed downloads)

    def register(self) -> httpx.Response:
        body = {
            "learner_id": self.id,
            "unit": f"unit-{self.id}",
            "plan": self.plan.to_dict(),
            "plan_hash": self.plan.hash(),
            "tokens_per_step": self.tokens_per_step,
        }
        return self.client.post("/v1/learners/register", json=body)

    def init(self, p: int, params: Mapping[str, np.ndarray]) -> httpx.Response:
        return self.client.put(f"/v1/fragments/{p}/init", content=encode_params(params, p))

    def contribute(
        self,
        p: int,
        base: int,
        blob: bytes,
        *,
        steps: int = 4,
        tokens: int | None = None,
        seq: int | None = None,
        since: int = 0,
    ) -> httpx.Response:
        if seq is None:
            self.seq += 1
            seq = self.seq
        params = {
            "base_version": base,
            "since": since,
            "steps": steps,
            "tokens": tokens if tokens is not None else steps * 8,
            "seq": seq,
        }
        return self.client.post(f"/v1/fragments/{p}/contributions", params=params, content=blob)

    def heartbeat(self, step: int, **extra: object) -> httpx.Response:
        body = {"step": step, "tokens": step * self.tokens_per_step, "step_time_s": 0.05, **extra}
        return self.client.post(f"/v1/learners/{self.id}/heartbeat", json=body)

    def fetch(
        self,
        p: int,
        newer_than: int = -1,
        wait: float = 0.0,
        have: tuple[int, Mapping[str, np.ndarray]] | None = None,
    ) -> tuple[int, dict[str, np.ndarray]] | None:
        """The newest version if newer than ``newer_than``; ``have``: the version held exactly, to
        which an update payload (compressed downloads) is applied. ``self.updates`` counts those."""
        params = {"newer_than": newer_than, "wait": wait, **({"have": have[0]} if have else {})}
        r = self.client.get(f"/v1/fragments/{p}", params=params, timeout=wait + 30)
        if r.status_code == 304:
            return None
        r.raise_for_status()
        version = int(r.headers[VERSION_HEADER])
        payload = codec.decode(r.content, fragment=self.plan.fragments[p])
        if payload.kind == "update":
            assert have is not None, "an update payload to a learner that holds no version"
            made = downlink.apply_decoded(have[0], have[1], payload)
            assert made is not None
            assert made[0] == version
            self.updates += 1
            return made
        assert payload.kind == "params"
        return version, payload.tensors

    def close(self) -> None:
        self.client.close()


def status(base_url: str) -> dict[str, object]:
    r = httpx.get(f"{base_url}/v1/status", timeout=10)
    r.raise_for_status()
    data: dict[str, object] = r.json()
    return data
