"""Held-out loss of the GLOBAL model, computed by the runner itself.

The runner fetches every fragment's newest global parameters from the synchronizer
(``GET /v1/fragments/{p}``, as a read-only client with a token derived from the job secret), loads
them into the built-in model and evaluates it on the same held-out windows the learners use. This
measures the model the job actually produces, independent of any one learner's local state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from diloco_core import codec
from diloco_core.auth import learner_token
from diloco_core.codec import CodecError, decode
from diloco_core.config import DataSettings, ModelSettings, Precision, TrainSettings
from diloco_core.wire import WireTally

log = logging.getLogger(__name__)

EVALUATOR_ID = "runner-eval"


@dataclass(frozen=True)
class Evaluation:
    loss: float
    versions: dict[int, int]


class GlobalEvaluator:
    """Evaluates the synchronizer's global parameters (needs PyTorch and ``diloco_worker``)."""

    def __init__(
        self,
        *,
        sync_url: str,
        job_secret: str,
        model: ModelSettings,
        data: DataSettings,
        batch_size: int,
        fragments: int,
        corpus_max_bytes: int,
        precision: Precision = "auto",
        device: str = "cpu",
        wire: WireTally | None = None,
    ) -> None:
        """The model and the held-out batches are the job's task's (``model.entry_point``: the built-in
        GPT or the user's), on the learners' data read as they read it (``corpus_max_bytes``);
        ``device``: where the model is evaluated (a GPU under bf16 autocast, as the learners train
        there); ``wire``: where its downloads' bytes at the socket are counted."""
        import torch
        from diloco_worker.data import Shard
        from diloco_worker.entry import TaskContext, load_task
        from diloco_worker.sync_client import SyncClient

        torch.set_num_threads(1)
        self._torch = torch
        self._device = torch.device(device)
        self._task = load_task(
            TaskContext(
                model,
                data.model_copy(update={"sample_log": None}),
                TrainSettings(batch_size=batch_size),
                Shard(0, 1, EVALUATOR_ID),
                self._device,
                corpus_max_bytes,
            )
        )
        if not self._task.eval_batches:
            raise ValueError(
                f"the task of {model.entry_point!r} has no held-out batches: nothing to evaluate on"
            )
        self._model = self._task.model.to(self._device).eval()
        self._precision = precision
        self._client = SyncClient(
            sync_url, EVALUATOR_ID, learner_token(job_secret, EVALUATOR_ID), timeout_s=10.0, wire=wire
        )
        self._fragments = fragments
        self.num_params = sum(p.numel() for p in self._model.parameters())
        self._payload_bound = codec.max_bytes_for_values(self.num_params)  # a fragment: at most the model

    def close(self) -> None:
        self._client.close()

    def fetch_params(self) -> tuple[dict[str, object], dict[int, int]] | None:
        """Every fragment's newest tensors and versions, or None while some fragment has none yet."""
        from diloco_worker.sync_client import GlobalFragment, SyncError

        tensors: dict[str, object] = {}
        versions: dict[int, int] = {}
        for p in range(self._fragments):
            try:
                got = self._client.fetch(p, newer_than=-1, wait_s=0.0)
            except SyncError as exc:
                log.debug("fragment %d not available for evaluation: %s", p, exc)
                return None
            if not isinstance(got, GlobalFragment):  # None: no version yet (rounds are not announced)
                return None
            try:
                payload = decode(got.payload, max_bytes=self._payload_bound)
            except CodecError as exc:
                log.warning("fragment %d version %d does not decode: %s", p, got.version, exc)
                return None
            tensors.update(payload.tensors)
            versions[p] = got.version
        return tensors, versions

    def evaluate(self) -> Evaluation | None:
        fetched = self.fetch_params()
        if fetched is None:
            return None
        tensors, versions = fetched
        torch = self._torch
        with torch.no_grad():
            for name, param in self._model.named_parameters():
                if name not in tensors:
                    log.warning("global parameters lack %r; skipping evaluation", name)
                    return None
                param.copy_(torch.as_tensor(tensors[name]).view_as(param))
        from diloco_worker.train import evaluate

        loss = evaluate(self._model, self._task, self._device, self._precision)
        return None if loss is None else Evaluation(loss, versions)


class LossTracker:
    """When to evaluate the global model: whenever its versions changed, at most every
    ``interval_s``, and once at the end. ``make`` builds the evaluator (PyTorch loads then)."""

    def __init__(self, make: Callable[[], GlobalEvaluator], interval_s: float) -> None:
        self._make, self.interval_s = make, interval_s
        self.evaluator: GlobalEvaluator | None = None
        self._last_s = -1e9
        self._last_versions: dict[int, int] = {}

    def load(self) -> GlobalEvaluator:
        if self.evaluator is None:
            self.evaluator = self._make()
        return self.evaluator

    def due(self, versions: dict[int, int], now: float) -> bool:
        """Every fragment has a global version, one changed since the last evaluation, and the
        interval has passed."""
        if not versions or min(versions.values()) < 0 or versions == self._last_versions:
            return False
        return now - self._last_s >= self.interval_s

    def evaluate(self, now: float) -> float | None:
        """The held-out loss of the global model now (None while some fragment has no version)."""
        result = self.load().evaluate()
        self._last_s = now
        if result is None:
            return None
        self._last_versions = result.versions
        return result.loss

    def close(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
