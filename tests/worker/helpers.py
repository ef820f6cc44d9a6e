"""Tiny settings and a synchronizer/learner harness for the worker tests."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from diloco_core.auth import learner_token
from diloco_core.codec import decode
from diloco_core.config import DataSettings, ModelSettings, TrainSettings
from diloco_core.request_proof import ProofAuth
from diloco_testbed.ports import free_port
from diloco_testbed.process import ManagedProcess
from diloco_testbed.waiting import wait_for
from diloco_worker.data import eval_batches, load_corpus, split_corpus
from diloco_worker.model import build_gpt, lm_loss

SECRET = "test-secret"
CORPUS_BYTES = 300_000
TINY = ModelSettings(n_layer=2, n_head=2, n_embd=32, block_size=32, seed=0)

TINY_FLAGS = [
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "32",
    "--batch-size",
    "8",
    "--corpus-max-bytes",
    str(CORPUS_BYTES),
    "--threads",
    "1",
    "--log-every",
    "1",
    "--poll-wait",
    "2",
]


def tiny_train(max_steps: int = 20, **kw: Any) -> TrainSettings:
    return TrainSettings(batch_size=4, max_steps=max_steps, warmup_steps=3, lr=3e-3, **kw)


class Synchronizer:
    """A real synchronizer process on a free port with filesystem storage."""

    def __init__(
        self,
        tmp: Path,
        *,
        inner_steps: int,
        fragments: int,
        overlap: int = 1,
        quorum: int = 1,
        extra: Sequence[str] = (),
        port: int | None = None,
        tls: tuple[Path, Path, Path] | None = None,
    ) -> None:
        """``tls``: (certificate, key, CA bundle): the synchronizer serves HTTPS, trusted by that CA."""
        self.port = port or free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        if tls is not None:
            extra = [*extra, "--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
        argv = [
            sys.executable,
            "-m",
            "diloco_sync",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--storage",
            f"file://{tmp / 'sync-store'}",
            "--inner-steps",
            str(inner_steps),
            "--fragments",
            str(fragments),
            "--overlap",
            str(overlap),
            "--quorum",
            str(quorum),
            "--codec",
            "int8",
            "--heartbeat-interval-s",
            "1",
            *extra,
        ]
        self.proc = ManagedProcess(
            "synchronizer", argv, tmp / "sync.log", env=clean_env({"DILOCO_JOB_SECRET": SECRET})
        )
        verify = ssl.create_default_context(cafile=str(tls[2])) if tls else True
        self.http = httpx.Client(base_url=self.url, timeout=10.0, verify=verify)

    def start(self) -> None:
        self.proc.start()
        wait_for(self._ready, timeout=60, what="synchronizer ready", describe=self.proc.failure_report)

    def _ready(self) -> bool:
        if not self.proc.running():
            raise AssertionError(self.proc.failure_report())
        return self.http.get("/readyz").status_code == 200

    def stop(self) -> None:
        self.proc.stop()

    def status(self) -> dict[str, Any]:
        resp = self.http.get("/v1/status")
        resp.raise_for_status()
        data: dict[str, Any] = resp.json()
        return data

    def learner_steps(self) -> dict[str, int]:
        return {lr["learner_id"]: lr["step"] for lr in self.status()["learners"]}

    def versions(self) -> dict[int, int]:
        return {f["fragment"]: f["version"] for f in self.status()["fragments"]}

    def global_params(self, observer: str = "observer") -> dict[str, np.ndarray]:
        """Every fragment's newest global version, fetched like a learner does."""
        signed = {
            "headers": {"X-DiLoCo-Learner": observer},
            "auth": ProofAuth(learner_token(SECRET, observer)),
        }
        out: dict[str, np.ndarray] = {}
        for p in self.versions():
            resp = self.http.get(f"/v1/fragments/{p}", params={"newer_than": -1, "wait": 0}, **signed)
            assert resp.status_code == 200, resp.text
            out.update(decode(resp.content).tensors)
        return out


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The test environment without DILOCO_* variables (they configure the servers), plus ``extra``."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env.update(extra or {})
    return env


def learner_process(
    tmp: Path, name: str, sync_url: str, flags: Sequence[str], env: dict[str, str] | None = None
) -> ManagedProcess:
    argv = [
        sys.executable,
        "-m",
        "diloco_worker",
        "--sync-url",
        sync_url,
        "--learner-id",
        name,
        "--job-secret",
        SECRET,
        "--metrics-file",
        str(tmp / f"{name}.jsonl"),
        *TINY_FLAGS,
        *flags,
    ]
    return ManagedProcess(name, argv, tmp / f"{name}.log", env=clean_env(env))


def last_metric(path: Path) -> dict[str, Any] | None:
    try:
        lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    except OSError:
        return None
    return json.loads(lines[-1]) if lines else None


def metric_step(path: Path) -> int:
    m = last_metric(path)
    return int(m["step"]) if m else 0


def held_out_loss(params: dict[str, np.ndarray] | None, model_settings: ModelSettings = TINY) -> float:
    """Loss of the built-in model (``params`` loaded into it, or its seeded start) on the held-out split."""
    model = build_gpt(model_settings)
    if params is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.from_numpy(params[name]))
    _, held = split_corpus(load_corpus(DataSettings().corpus, CORPUS_BYTES), DataSettings().eval_fraction)
    batches = eval_batches(held, batch_size=8, block_size=model_settings.block_size, max_batches=4)
    model.eval()
    with torch.no_grad():
        return float(np.mean([float(lm_loss(model, b)) for b in batches]))


def iter_logs(proc: ManagedProcess) -> Iterator[str]:
    try:
        yield from proc.log_path.read_text(errors="replace").splitlines()
    except OSError:
        return


def run_on_two_ranks(script: str) -> list[str]:
    """``script`` run as ranks 0 and 1 of a unit of two processes (its arguments: the rank, then the
    port of rank 0's rendezvous); each rank's output, once both exited 0."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    return outputs
