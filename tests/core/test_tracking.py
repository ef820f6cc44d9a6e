"""Experiment tracking: TensorBoard event files on disk and in S3 (SeaweedFS), W&B offline, MLflow on a
local store, and a sink whose storage goes away."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from diloco_core.config import TrackingSettings
from diloco_core.storage import S3Store
from diloco_core.tracking import TensorBoardSink, Tracking, TrackingError, _require, open_tracking
from diloco_testbed.s3_server import S3Server
from diloco_testbed.waiting import wait_for

from tests.support import wandb_files
from tests.support.tensorboard_files import read_scalars


def test_no_sink_asked_for_means_no_tracking() -> None:
    assert open_tracking(TrackingSettings(), run="a", group="job") is None


def test_tensorboard_in_a_folder_gets_every_record_in_order(tmp_path: Path) -> None:
    tracking = open_tracking(TrackingSettings(tensorboard=str(tmp_path / "tb")), run="learner-0", group="job")
    assert tracking is not None
    for step in range(1, 6):
        tracking.log(step, {"loss": 6.0 - step, "lr": 0.001 * step})
    tracking.close()
    scalars = read_scalars(tmp_path / "tb" / "learner-0")
    assert scalars["loss"] == [(s, 6.0 - s) for s in range(1, 6)]
    assert [step for step, _ in scalars["lr"]] == [1, 2, 3, 4, 5]


def test_a_file_url_is_a_folder(tmp_path: Path) -> None:
    sink = TensorBoardSink(f"file://{tmp_path}", "synchronizer-0")
    sink.log(1.0, 3, {"fragment_0/participants": 2.0})
    sink.close()
    assert read_scalars(tmp_path / "synchronizer-0") == {"fragment_0/participants": [(3, 2.0)]}


def _store(s3: S3Server, bucket: str, prefix: str) -> S3Store:
    """The server's store with its own credentials (the process's environment holds another server's)."""
    return S3Store(
        bucket, prefix, endpoint_url=s3.endpoint_url, region=s3.region, access_key=s3.access_key,
        secret_key=s3.secret_key,
    )  # fmt: skip


def _download(s3: S3Server, bucket: str, prefix: str, into: Path) -> list[str]:
    store = _store(s3, bucket, prefix)
    keys = sorted(store.list(""))
    for key in keys:
        (into / Path(key).name).write_bytes(store.get(key))
    return keys


@pytest.mark.integration
def test_tensorboard_on_object_storage_writes_one_event_file_per_flush(s3: S3Server, tmp_path: Path) -> None:
    bucket = s3.new_bucket()
    location = f"s3://{bucket}/job/tensorboard"
    sink = TensorBoardSink(location, "learner-1", store=_store(s3, bucket, "job/tensorboard"))
    sink.log(10.0, 1, {"loss": 5.0})
    sink.flush()
    sink.flush()  # nothing new: no object
    sink.log(11.0, 2, {"loss": 4.0})
    sink.log(12.0, 3, {"loss": 3.5})
    sink.close()
    keys = _download(s3, bucket, "job/tensorboard/learner-1", tmp_path)
    assert len(keys) == 2, keys
    assert read_scalars(tmp_path) == {"loss": [(1, 5.0), (2, 4.0), (3, 3.5)]}


@pytest.mark.integration
def test_records_logged_while_storage_is_down_are_written_once_it_is_back(
    s3_server_factory: Callable[[], S3Server],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    s3 = s3_server_factory()
    bucket = s3.new_bucket()
    store = _store(s3, bucket, "tb")
    tracking = Tracking(
        {"tensorboard": lambda: TensorBoardSink(f"s3://{bucket}/tb", "learner-0", store=store)},
        flush_every_s=0.2,
    )
    assert tracking.wait_open(30)
    s3.stop()  # a real outage: the server is gone
    with caplog.at_level(logging.WARNING, logger="diloco_core.tracking"):
        tracking.log(1, {"loss": 2.0})  # the caller never waits on, nor hears of, the failure
        tracking.log(2, {"loss": 1.5})
        wait_for(
            lambda: any("flush failed" in r.getMessage() for r in caplog.records),
            timeout=60,
            what="the failed flush logged",
        )
    s3.start()
    tracking.log(3, {"loss": 1.0})
    tracking.close()
    _download(s3, bucket, "tb/learner-0", tmp_path)
    assert read_scalars(tmp_path) == {"loss": [(1, 2.0), (2, 1.5), (3, 1.0)]}


def test_wandb_offline_run_holds_the_logged_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracking = open_tracking(
        TrackingSettings(wandb_project="diloco-test"),
        run="learner-0",
        group="job-1",
        config={"train": {"lr": 0.01}},
    )
    assert tracking is not None
    tracking.log(1, {"loss": 4.0})
    tracking.log(2, {"loss": 3.0, "tokens_per_s": 1000.0})
    tracking.close(timeout=120)
    assert "wandb" in tracking.sinks, "the W&B run opened"
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    # wandb's own service process writes the file: on a loaded machine it may finish just after finish()
    wait_for(
        lambda: len(wandb_files.history(run_file)) == 2, timeout=60, what="the W&B run's history written"
    )
    assert wandb_files.history(run_file) == [(1, {"loss": 4.0}), (2, {"loss": 3.0, "tokens_per_s": 1000.0})]
    assert wandb_files.config(run_file) == {"train": {"lr": 0.01}}


def test_mlflow_run_on_a_local_store_holds_each_metric_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks to be told a file store is meant

    uri = f"file://{tmp_path / 'mlruns'}"
    tracking = open_tracking(
        TrackingSettings(mlflow_tracking_uri=uri),
        run="learner-0",
        group="job-1",
        config={"train": {"lr": 0.01}},
    )
    assert tracking is not None
    for step in (1, 2, 3):
        tracking.log(step, {"loss": 5.0 - step})
    tracking.close(timeout=120)
    assert "mlflow" in tracking.sinks, "the MLflow run opened"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("job-1")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert (run.info.run_name, run.info.status) == ("learner-0", "FINISHED")
    assert run.data.params["train.lr"] == "0.01"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 4.0), (2, 3.0), (3, 2.0)]


def test_a_missing_package_is_an_error_at_start_up_that_names_the_fix() -> None:
    with pytest.raises(
        TrackingError, match=r"--wandb-project needs the 'no_such_tracker_pkg' package.*\[tracking\]"
    ):
        _require("no_such_tracker_pkg", "--wandb-project")
