"""The synchronizer's settings: consistency checks and the default body limits."""

from __future__ import annotations

import json

import pytest
from diloco_core.fragments import build_plan
from diloco_sync.settings import SyncSettings
from pydantic import ValidationError


def test_settings_refuse_inconsistent_shards_and_tls() -> None:
    with pytest.raises(ValidationError, match="shard_index"):
        SyncSettings(job_secret="x", storage_url="file:///x", shard_index=2, num_shards=2)
    with pytest.raises(ValidationError, match="shard URLs"):
        SyncSettings(job_secret="x", storage_url="file:///x", num_shards=2, shard_urls=("http://a",))
    with pytest.raises(ValidationError, match="TLS needs both"):
        SyncSettings(job_secret="x", storage_url="file:///x", tls_cert="/c.pem")
    s = SyncSettings(job_secret="x", storage_url="file:///x", shard_index=1, num_shards=2)
    assert s.owned_fragments == [1, 3]
    assert s.owns(3)
    assert not s.owns(2)
    assert not s.owns(9)


def test_settings_refuse_a_storage_endpoint_without_its_scheme() -> None:
    with pytest.raises(ValidationError, match="storage_endpoint_url") as refused:
        SyncSettings(job_secret="x", storage_url="s3://b", storage_endpoint_url="seaweedfs:8333")
    assert "'seaweedfs:8333' is not an S3 endpoint: expected an http:// or https:// URL" in str(refused.value)
    s = SyncSettings(job_secret="x", storage_url="s3://b", storage_endpoint_url="http://seaweedfs:8333")
    assert s.storage_endpoint_url == "http://seaweedfs:8333"


def test_the_default_json_body_limit_fits_the_registration_of_a_big_model() -> None:
    """A 128-layer transformer's plan (2,050 tensors, long names) in a register body, with room to spare."""
    names: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", [128256, 16384])]
    for i in range(128):
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):  # fmt: skip
            names += [
                (f"model.layers.{i}.{part}.weight", [16384, 53248]),
                (f"model.layers.{i}.{part}.bias", [16384]),
            ]
        names += [(f"model.layers.{i}.input_layernorm.weight", [16384]),
                  (f"model.layers.{i}.post_attention_layernorm.weight", [16384])]  # fmt: skip
    names.append(("model.norm.weight", [16384]))
    plan = build_plan(names, 32, 64, 4, embedding_names=("model.embed_tokens.weight",))
    body = {"learner_id": "learner-" + "x" * 100, "unit": "u" * 128, "plan": plan.to_dict(),
            "plan_hash": plan.hash(), "tokens_per_step": 1 << 20, "step": 10**9}  # fmt: skip
    size = len(json.dumps(body).encode())
    limit = SyncSettings(job_secret="x", storage_url="file:///x").max_json_body_bytes
    assert len(names) == 2050
    assert size < limit // 4, (size, limit)
