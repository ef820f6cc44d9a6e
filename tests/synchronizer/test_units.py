"""The synchronizer's pure pieces: auth decisions, storage layout, settings, backoff, learner liveness."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from diloco_core.auth import learner_token
from diloco_core.fragments import build_plan
from diloco_core.protocol import Heartbeat
from diloco_sync.auth import authenticate
from diloco_sync.cli import UsageError, parse_settings
from diloco_sync.errors import ApiError
from diloco_sync.fragment_state import Contribution, FragmentState
from diloco_sync.layout import (
    Layout,
    LayoutError,
    LearnerRecord,
    PendingMeta,
    contribution_key,
    pack_pending,
    unpack_pending,
    version_of_key,
)
from diloco_sync.learners import LearnerRegistry, step_time_ema
from diloco_sync.merging import new_optimizer, recent_round_keys, rounds_from_logs
from diloco_sync.round_loop import applied_to_keep
from diloco_sync.settings import SyncSettings
from diloco_sync.storage_guard import backoff_delays
from pydantic import ValidationError

from tests.synchronizer.helpers import tiny_plan

SECRET = "s3cret"


def bearer(learner: str) -> str:
    return f"Bearer {learner_token(SECRET, learner)}"


@pytest.mark.parametrize(
    ("authorization", "claimed", "subject", "status", "code"),
    [
        (None, "a", None, 401, "unauthenticated"),
        ("Basic abc", "a", None, 401, "unauthenticated"),
        (bearer("a"), None, None, 401, "unauthenticated"),
        ("Bearer deadbeef", "a", None, 401, "unauthenticated"),
        (bearer("b"), "a", None, 403, "forbidden"),  # b's token, claiming to be a
        (bearer("a"), "a", "b", 403, "forbidden"),  # a acting for b
        (bearer("zz"), "a", None, 401, "unauthenticated"),  # a token of nobody registered
    ],
)
def test_authenticate_refusals(
    authorization: str | None, claimed: str | None, subject: str | None, status: int, code: str
) -> None:
    with pytest.raises(ApiError) as info:
        authenticate(SECRET, authorization, claimed, subject=subject, known_learners=["a", "b"])
    assert (info.value.status, info.value.code) == (status, code)


def test_authenticate_accepts_own_token() -> None:
    assert authenticate(SECRET, bearer("a"), "a", subject="a", known_learners=["a"]) == "a"


def test_pending_objects_round_trip_and_reject_garbage() -> None:
    meta = PendingMeta(
        learner_id="l-1", fragment=2, base_version=7, seq=3, steps=4, tokens=99, received_at=1.5
    )
    assert unpack_pending(pack_pending(meta, b"payload")) == (meta, b"payload")
    with pytest.raises(LayoutError, match="not a pending"):
        unpack_pending(b"XXXX\x00\x00\x00\x00")
    with pytest.raises(LayoutError, match="truncated"):
        unpack_pending(pack_pending(meta, b"")[:12])


def test_layout_keys_and_versions() -> None:
    layout = Layout(1)
    assert layout.params(3, 12) == "shard-001/fragments/3/params-0000000012.bin"
    assert version_of_key(layout.params(3, 12)) == 12
    assert version_of_key(layout.outer(0, 5)) == 5
    assert version_of_key("shard-001/fragments/3/.tmp-x") is None
    assert layout.pending(1, "a", 2, 3) == "shard-001/pending/1/a/2-3.bin"
    assert contribution_key("a", 1, 2, 3) == "a/1/2/3"


def test_applied_keys_forget_what_would_be_stale_anyway() -> None:
    keys = ["a/0/1/0", "a/0/5/1", "b/0/6/0", "c/0/3/9"]
    assert applied_to_keep(keys, version=7, max_staleness=2) == ["a/0/5/1", "b/0/6/0"]


def test_backoff_doubles_up_to_the_cap() -> None:
    assert backoff_delays(0.1, 1.0) == [0.1, 0.2, 0.4, 0.8, 1.0]


def test_liveness_is_a_function_of_time() -> None:
    reg = LearnerRegistry(heartbeat_timeout_s=10)
    reg.register(LearnerRecord(learner_id="a"), step=0, now=100.0)
    reg.register(LearnerRecord(learner_id="b"), step=0, now=100.0)
    reg.heartbeat("b", Heartbeat(step=5, tokens=40, step_time_s=0.2), now=108.0)
    assert reg.alive_count(105.0) == 2
    assert reg.alive_count(111.0) == 1  # a timed out, b heard at 108
    status = {s.learner_id: s for s in reg.status(111.0, versions={})}
    assert status["a"].state == "dead"
    assert not status["a"].alive
    assert status["b"].state == "training"
    assert status["b"].step == 5
    assert reg.step_time(111.0) == 0.2  # only alive learners count
    reg.leave("b", 112.0)
    assert reg.alive_count(112.0) == 0
    assert reg.step_time(112.0) == 0.0


def test_long_poll_wakes_on_publish() -> None:
    plan = tiny_plan()

    async def scenario() -> tuple[str | None, str | None]:
        fs = FragmentState(
            spec=plan.fragments[0],
            optimizer=new_optimizer(SyncSettings(job_secret="x", storage_url="file:///tmp/x").job.diloco),
        )
        waiter = asyncio.create_task(fs.wait_newer(-1, 10.0))
        await asyncio.sleep(0.01)
        fs.publish(0, {"wte.weight": np.zeros((16, 8), np.float32)}, b"blob")
        woke = await waiter
        timed_out = await fs.wait_newer(0, 0.05)
        return woke, timed_out

    assert asyncio.run(scenario()) == ("version", None)


def _contribution(learner: str, base: int, at: float) -> Contribution:
    return Contribution(
        learner_id=learner, fragment=0, base_version=base, seq=1, steps=2, tokens=16, tensors={},
        nbytes=0, received_at=at,
    )  # fmt: skip


def test_an_opening_round_wakes_the_learners_that_have_not_joined_it() -> None:
    plan = tiny_plan()

    async def scenario() -> tuple[str | None, str | None, str | None, bool]:
        fs = FragmentState(
            spec=plan.fragments[0],
            optimizer=new_optimizer(SyncSettings(job_secret="x", storage_url="file:///tmp/x").job.diloco),
        )
        fs.publish(0, {"wte.weight": np.zeros((16, 8), np.float32)}, b"blob")
        waiter = asyncio.create_task(fs.wait_newer(0, 10.0, round_for="b"))
        await asyncio.sleep(0.01)
        fs.add_pending(_contribution("a", 0, 1.0), quorum=1)  # the round on version 0 opens
        woke = await waiter
        joined = await fs.wait_newer(0, 0.05, round_for="a")  # a is in the round: nothing to tell it
        not_asked = await fs.wait_newer(0, 0.05)  # a plain long-poll never hears of rounds
        fs.merging = True
        return woke, joined, not_asked, fs.round_open_for("b", 0)

    assert asyncio.run(scenario()) == ("round", None, None, False)


def test_the_grace_window_uses_an_ema_of_the_reported_step_times() -> None:
    assert step_time_ema(0.0, 2.0) == 2.0
    assert step_time_ema(2.0, 0.0) == 2.0  # a heartbeat without a step time changes nothing
    assert step_time_ema(2.0, 4.0, weight=0.25) == pytest.approx(2.5)


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


def test_cli_needs_a_job_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DILOCO_JOB_SECRET", raising=False)
    with pytest.raises(UsageError, match="DILOCO_JOB_SECRET"):
        parse_settings([])


def test_cli_reads_flags_environment_and_job_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("job_id: demo\ndiloco:\n  inner_steps: 16\n  fragments: 8\n  quorum: 2\n")
    monkeypatch.setenv("DILOCO_JOB_SECRET", "from-env")
    monkeypatch.setenv("DILOCO_PORT", "9999")
    s = parse_settings(["--job-config", str(config), "--quorum", "3", "--data-dir", str(tmp_path / "d")])
    assert s.job_secret.get_secret_value() == "from-env"
    assert s.port == 9999
    assert s.storage_url == f"file://{tmp_path / 'd'}"
    assert (s.job.job_id, s.job.diloco.inner_steps, s.job.diloco.fragments, s.job.diloco.quorum) == (
        "demo",
        16,
        8,
        3,
    )


def test_cli_reports_invalid_settings_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DILOCO_JOB_SECRET", "x")
    with pytest.raises(UsageError, match="overlap"):
        parse_settings(["--inner-steps", "4", "--overlap", "4"])
    monkeypatch.setenv("DILOCO_PORT", "not-a-port")
    with pytest.raises(UsageError, match="DILOCO_PORT"):
        parse_settings([])


def test_recent_rounds_come_back_from_the_round_logs_newest_last() -> None:
    assert recent_round_keys({0: 3, 1: 1}, 2) == [(0, 3), (0, 2), (1, 1)]
    assert recent_round_keys({0: 0}, 5) == []

    def entry(p: int, v: int, at: float) -> dict[str, object]:
        return {"fragment": p, "version": v, "participants": ["a"], "weights": [1.0], "base_versions": [v - 1],
                "finished_at": at, "quorum_wait_s": 0.1, "grace_s": 0.0, "merge_s": 0.01, "keys": ["k"]}

    logs = [entry(0, 3, 30.0), entry(0, 2, 10.0), entry(1, 2, 20.0), {"fragment": 1}]  # the last: unreadable
    rounds = rounds_from_logs(logs, 2)
    assert [(r.fragment, r.version) for r in rounds] == [(1, 2), (0, 3)]


def test_cli_reads_s3_keys_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DILOCO_JOB_SECRET", "x")
    monkeypatch.setenv("DILOCO_STORAGE_SECRET_KEY", "s3-secret")
    s = parse_settings(["--storage", "s3://b/p", "--storage-access-key", "AKID"])
    assert s.storage_access_key == "AKID"
    assert s.storage_secret_key is not None
    assert s.storage_secret_key.get_secret_value() == "s3-secret"
    assert "s3-secret" not in repr(s)
    monkeypatch.delenv("DILOCO_STORAGE_SECRET_KEY")
    assert parse_settings(["--storage", "s3://b/p"]).storage_secret_key is None


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
