"""Experiment tracking: a process's scalars to TensorBoard event files, Weights & Biases and MLflow.

The caller only queues (:meth:`Tracking.log` never waits on a sink): one background thread feeds the
sinks and flushes them every ``flush_every_s``. A sink that fails (storage down, a tracking server
away) is logged and tried again at the next record; tracking never stops training. W&B and MLflow are
optional packages (``pip install 'diloco-k8s[tracking]'``), checked when tracking is opened, so a
missing one is an error at start-up rather than a silent gap.

TensorBoard event files go to ``<tensorboard>/<run>/``: ``tensorboard`` is a folder (appended to as
records come) or an object-storage URL (``s3://bucket/prefix``: objects cannot be appended to, so each
flush writes the records since the previous one as a new event file; TensorBoard reads a run's files
in name order).
"""

from __future__ import annotations

import importlib.util
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from .config import TrackingSettings
from .storage import ObjectStore, open_store
from .tfevents import file_name, scalars_event, version_event

log = logging.getLogger(__name__)

__all__ = ["Sink", "TensorBoardSink", "Tracking", "TrackingError", "open_tracking"]

Scalars = Mapping[str, float]


class TrackingError(ValueError):
    """Tracking asked for something this installation cannot do (a missing package, a bad location)."""


class Sink(Protocol):
    def log(self, wall_time: float, step: int, scalars: Scalars) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """One run's event files: appended to a local file, or one new object per flush on object storage."""

    def __init__(
        self,
        location: str,
        run: str,
        *,
        store: ObjectStore | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``store``: the object store of ``location`` when the caller has it open (credentials given)."""
        self.run = run
        self._started = clock()
        self._local: Path | None = None
        self._store: ObjectStore | None = store
        if store is None and ("://" not in location or location.startswith("file://")):
            folder = Path(location.removeprefix("file://")) / run
            folder.mkdir(parents=True, exist_ok=True)
            self._local = folder / file_name(self._started)
            self._local.write_bytes(version_event(self._started))
        elif store is None:
            self._store = open_store(location)
        self._pending = bytearray()
        self._written = 0  # event files written to the store so far

    def log(self, wall_time: float, step: int, scalars: Scalars) -> None:
        record = scalars_event(wall_time, step, scalars)
        if self._local is not None:
            with self._local.open("ab") as f:
                f.write(record)
        else:
            self._pending += record

    def flush(self) -> None:
        if self._store is None or not self._pending:
            return
        data = version_event(self._started) + bytes(self._pending)
        key = f"{self.run}/{file_name(self._started, f'.{self._written:06d}')}"
        self._store.put(key, data)  # a failure keeps the records for the next flush
        self._written += 1
        self._pending.clear()

    def close(self) -> None:
        self.flush()


class WandbSink:
    """A W&B run (``WANDB_API_KEY``, ``WANDB_MODE=offline`` and the rest are read by ``wandb`` itself)."""

    def __init__(self, project: str, run: str, group: str, config: Mapping[str, Any]) -> None:
        import wandb

        self._run = wandb.init(
            project=project,
            name=run,
            group=group,
            config=dict(config),
            reinit="create_new",
        )

    def log(self, wall_time: float, step: int, scalars: Scalars) -> None:
        self._run.log(dict(scalars), step=step)

    def flush(self) -> None:
        return None  # wandb sends in its own service process

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    """An MLflow run in the experiment named after the job, on ``tracking_uri`` (a server or a store)."""

    def __init__(self, tracking_uri: str, experiment: str, run: str, config: Mapping[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=tracking_uri)
        found = self._client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self._client.create_experiment(experiment)
        self._run_id = self._client.create_run(experiment_id, run_name=run).info.run_id
        params = {k: str(v)[:500] for k, v in _flatten(config).items()}
        if params:
            from mlflow.entities import Param

            self._client.log_batch(self._run_id, params=[Param(k, v) for k, v in params.items()])
        self._pending: list[Any] = []

    def log(self, wall_time: float, step: int, scalars: Scalars) -> None:
        from mlflow.entities import Metric

        stamp = int(wall_time * 1000)
        self._pending += [Metric(tag, float(v), stamp, step) for tag, v in scalars.items()]

    def flush(self) -> None:
        while self._pending:  # the store takes at most 1,000 metrics a batch
            batch = self._pending[:1000]
            self._client.log_batch(self._run_id, metrics=batch)
            del self._pending[: len(batch)]

    def close(self) -> None:
        self.flush()
        self._client.set_terminated(self._run_id)


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


_STOP = object()


class Tracking:
    """Scalars to every sink, from one background thread. ``sinks`` are built on that thread (W&B and
    MLflow runs take seconds to open); one that cannot be built is logged and left out."""

    def __init__(
        self, factories: Mapping[str, Callable[[], Sink]], *, flush_every_s: float, max_queued: int = 10_000
    ) -> None:
        self._factories = dict(factories)
        self._flush_every_s = flush_every_s
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queued)
        self.dropped = 0  # records the queue had no room for
        self.sinks: dict[str, Sink] = {}
        self._opened = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tracking", daemon=True)
        self._thread.start()

    def log(self, step: int, scalars: Scalars, wall_time: float | None = None) -> None:
        values = {k: float(v) for k, v in scalars.items()}
        try:
            self._queue.put_nowait((time.time() if wall_time is None else wall_time, step, values))
        except queue.Full:
            self.dropped += 1

    def wait_open(self, timeout: float) -> bool:
        return self._opened.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, flush and close every sink (bounded by ``timeout``)."""
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)
        if self.dropped:
            log.warning("tracking: %d records were dropped, the queue being full", self.dropped)

    def _run(self) -> None:
        for name, factory in self._factories.items():
            try:
                self.sinks[name] = factory()
            except Exception as exc:
                log.warning("tracking: %s could not be opened, left out: %s", name, exc)
        self._opened.set()
        failing: set[str] = set()
        next_flush = time.monotonic() + self._flush_every_s
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, next_flush - time.monotonic()))
            except queue.Empty:
                item = None
            if item is _STOP:
                self._each(failing, "close")
                return
            if item is not None:
                wall_time, step, values = item
                self._each(failing, "log", wall_time, step, values)
            if time.monotonic() >= next_flush:
                self._each(failing, "flush")
                next_flush = time.monotonic() + self._flush_every_s

    def _each(self, failing: set[str], what: str, *args: Any) -> None:
        """``sink.<what>(*args)`` on every sink; a failure is logged once until the sink works again."""
        for name, sink in self.sinks.items():
            try:
                getattr(sink, what)(*args)
            except Exception as exc:  # a sink's outage never reaches the caller
                if name not in failing:
                    log.warning("tracking: %s %s failed (retried with the next records): %s", name, what, exc)
                failing.add(name)
            else:
                failing.discard(name)


def _require(package: str, option: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise TrackingError(
            f"{option} needs the {package!r} package, which is not installed: "
            "pip install 'diloco-k8s[tracking]'"
        )


def open_tracking(
    settings: TrackingSettings, *, run: str, group: str, config: Mapping[str, Any] | None = None
) -> Tracking | None:
    """The sinks ``settings`` asks for, for the run named ``run`` of job ``group``; None when none."""
    config = config or {}
    factories: dict[str, Callable[[], Sink]] = {}
    if settings.tensorboard:
        location = settings.tensorboard
        factories["tensorboard"] = lambda: TensorBoardSink(location, run)
    if settings.wandb_project:
        _require("wandb", "--wandb-project")
        project = settings.wandb_project
        factories["wandb"] = lambda: WandbSink(project, run, group, config)
    if settings.mlflow_tracking_uri:
        _require("mlflow", "--mlflow-tracking-uri")
        uri = settings.mlflow_tracking_uri
        factories["mlflow"] = lambda: MlflowSink(uri, group, run, config)
    if not factories:
        return None
    return Tracking(factories, flush_every_s=settings.flush_every_s)
