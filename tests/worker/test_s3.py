"""Checkpoints and the corpus on a real S3 server (SeaweedFS)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from diloco_testbed.s3_server import S3Server
from diloco_worker.checkpoint import list_checkpoints, load_latest, open_checkpoint_store
from diloco_worker.data import load_corpus
from diloco_worker.learner import run_learner
from diloco_worker.settings import WorkerSettings

from tests.worker.helpers import CORPUS_BYTES, TINY, tiny_train

pytestmark = pytest.mark.integration


@pytest.fixture
def s3_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    return s3


def test_checkpoints_go_to_s3_and_a_restart_resumes_from_them(s3_env: S3Server) -> None:
    bucket = s3_env.new_bucket("ckpt")
    location = f"s3://{bucket}/learners/a"
    settings = WorkerSettings(
        standalone=True,
        model=TINY,
        train=tiny_train(max_steps=8, checkpoint_every=3),
        checkpoint_dir=location,
        corpus_max_bytes=CORPUS_BYTES,
        threads=1,
        stop_at_step=4,
    )
    assert run_learner(settings, {}, threading.Event()) == 0
    store = open_checkpoint_store(location)
    assert list_checkpoints(store) == [3, 4]
    assert run_learner(settings.model_copy(update={"stop_at_step": 0}), {}, threading.Event()) == 0
    assert list_checkpoints(store) == [6, 8]
    ckpt = load_latest(store)
    assert ckpt is not None
    assert ckpt.meta["loop"]["step"] == 8
    assert ckpt.meta["loop"]["cursor"] == 8
    assert "token" not in ckpt.meta["config"]
    assert all(torch.isfinite(t).all() for k, t in ckpt.tensors.items() if k.startswith("param/"))


def test_corpus_from_an_s3_prefix_in_key_order(s3_env: S3Server, tmp_path: Path) -> None:
    bucket = s3_env.new_bucket("corpus")
    client = s3_env.client()
    client.put_object(Bucket=bucket, Key="text/b.txt", Body=b"B" * 800)
    client.put_object(Bucket=bucket, Key="text/a.txt", Body=b"A" * 800)
    client.put_object(Bucket=bucket, Key="other/c.txt", Body=b"C" * 800)
    data = bytes(load_corpus(f"s3://{bucket}/text/", 10_000))
    assert data == b"A" * 800 + b"B" * 800
