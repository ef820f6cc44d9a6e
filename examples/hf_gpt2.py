"""A Hugging Face causal LM for ``--entry-point hf_gpt2:build`` (see docs/user-models.md).

A ``transformers`` GPT-2, built from a config sized by the job's model settings (``nLayer``,
``nHead``, ``nEmbd``, ``blockSize``, ``vocabSize``), or, with ``HF_INIT_FROM`` set to a
``save_pretrained`` folder or an ``s3://`` prefix holding one, loaded from its weights (continued
pre-training; the folder's config wins).
It trains on the job's token data (``data.format: tokens`` or ``parquet``) as Hugging Face batches
``{"input_ids", "labels"}``, and its loss is ``model(**batch).loss``, as in ``transformers``.

    PYTHONPATH=examples diloco run -f job.yaml    # spec.model.entryPoint: hf_gpt2:build
"""

from __future__ import annotations

import os
from typing import Any

import torch
from diloco_worker.data_sources import local_folder, resolve_cache_dir
from diloco_worker.entry import TaskContext, TrainingTask
from diloco_worker.tokens import token_batches
from transformers import GPT2Config, GPT2LMHeadModel


def hf_loss(model: Any, batch: dict[str, Any]) -> Any:
    return model(**batch).loss


def build(ctx: TaskContext) -> TrainingTask:
    init_from = os.environ.get("HF_INIT_FROM")
    if init_from:  # a folder, or an s3:// prefix downloaded into the data cache
        cache = resolve_cache_dir(ctx.data.cache_dir)
        model = GPT2LMHeadModel.from_pretrained(
            local_folder(init_from, cache, "HF_INIT_FROM: a save_pretrained folder")
        )
    else:
        m = ctx.model
        torch.manual_seed(m.seed)  # the same start on every learner (the synchronizer keeps the first's)
        config = GPT2Config(
            vocab_size=m.vocab_size, n_positions=m.block_size, n_embd=m.n_embd, n_layer=m.n_layer,
            n_head=m.n_head, resid_pdrop=m.dropout, embd_pdrop=m.dropout, attn_pdrop=m.dropout,
        )  # fmt: skip
        model = GPT2LMHeadModel(config)
    data = token_batches(ctx, as_dict=True, vocab_size=model.config.vocab_size)
    return TrainingTask(
        model,
        hf_loss,
        data.make_batches,
        data.eval_batches,
        # the token and position embeddings (the output layer is tied to the token embedding)
        embedding_names=("transformer.wte.weight", "transformer.wpe.weight"),
    )
