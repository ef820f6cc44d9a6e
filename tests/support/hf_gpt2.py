"""The small job of examples/hf_gpt2.py that the tests train (locally and as pods): its model, a
learnable token corpus, and the held-out loss ``transformers`` gives an exported model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diloco_core.config import DataSettings, ModelSettings, TrainSettings
from diloco_worker.data import Shard
from diloco_worker.entry import TaskContext
from diloco_worker.tokens import token_batches

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SETTINGS = ModelSettings(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=512)
MODEL = {  # spec.model of the job
    "entryPoint": "hf_gpt2:build",
    "nLayer": SETTINGS.n_layer,
    "nHead": SETTINGS.n_head,
    "nEmbd": SETTINGS.n_embd,
    "blockSize": SETTINGS.block_size,
    "vocabSize": SETTINGS.vocab_size,
}


def example_env(drop: tuple[str, ...] = ("DILOCO_",), **extra: str) -> dict[str, str]:
    """This process's environment for a ``diloco`` command that imports the example: the variables
    starting with ``drop`` left out, ``extra`` added, examples/ first on ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    path = os.pathsep.join([str(EXAMPLES), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env | extra | {"PYTHONPATH": path}


def write_tokens(path: Path, repeats: int = 800) -> Path:
    """A learnable uint16 corpus for the 512-id vocabulary: the ids 0..299 over and over."""
    np.tile(np.arange(300, dtype=np.uint16), repeats).tofile(path)
    return path


def held_out_loss(model: Any, corpus: Path, cache_dir: Path | None = None, batch_size: int = 4) -> float:
    """The mean loss of a ``transformers`` model on the held-out batches the job's task evaluates on."""
    data = DataSettings(corpus=str(corpus), format="tokens", cache_dir=str(cache_dir) if cache_dir else None)
    ctx = TaskContext(
        SETTINGS, data, TrainSettings(batch_size=batch_size), Shard(0, 1, "t"), torch.device("cpu")
    )
    with torch.no_grad():
        losses = [float(model(**b).loss) for b in token_batches(ctx, as_dict=True).eval_batches]
    return float(np.mean(losses))
