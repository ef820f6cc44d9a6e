"""The HTTP API against a real synchronizer process: registration, init, rounds, long-poll, status.

The round trip runs against both object stores (a file:// folder and a real S3 server)."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest
from diloco_core.bounds import FRAGMENT_KEY_PATTERN, MAX_STEP_TIME_S
from diloco_core.fragments import FragmentPlan
from diloco_core.protocol import (
    API_PREFIX,
    CONTRIBUTIONS_PATH,
    FRAGMENT_PATH,
    HEARTBEAT_PATH,
    INIT_PATH,
    LEAVE_PATH,
    REGISTER_PATH,
    STATUS_PATH,
)

from tests.synchronizer.conftest import StoreTarget, SyncFactory
from tests.synchronizer.helpers import (
    Learner,
    SyncProcess,
    encode_grad,
    initial_params,
    outer_grad,
    status,
    tiny_plan,
)

pytestmark = pytest.mark.integration
# the outer step and downloads the expected values below are written for (not the job's defaults)
OUTER = ["--outer-lr", "0.7", "--outer-momentum", "0.9", "--outer-warmup", "0", "--down-codec", "fp32"]
ARGS = ["--fragments", "2", "--inner-steps", "4", "--overlap", "1", "--quorum", "3", *OUTER]


def expected_after_round(theta: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]], lr: float = 0.7):
    """Embedding fragment, equal weights, first round: plain mean, then Nesterov with u = Δ."""
    out = {}
    for name, value in theta.items():
        delta = np.mean([g[name] for g in grads], axis=0)
        out[name] = value - lr * (delta + 0.9 * delta)
    return out


def test_three_learners_round_trip(sync_factory: SyncFactory, store: StoreTarget) -> None:
    sync = sync_factory(store.url("round-trip"), ARGS, store.env)
    plan = tiny_plan()
    learners = [Learner(sync.url, f"l{i}", plan) for i in range(3)]
    first = learners[0].register()
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["plan_hash"] == plan.hash()
    # the registration answers the job's plan itself, and plan_hash is its hash
    assert FragmentPlan.from_dict(body["plan"]).hash() == body["plan_hash"]
    assert body["plan"] == plan.to_dict()
    assert body["needs_init"] == [0, 1]
    assert body["versions"] == {"0": -1, "1": -1}
    assert body["diloco"]["quorum"] == 3
    for learner in learners[1:]:
        again = learner.register()
        assert again.status_code == 200
        assert FragmentPlan.from_dict(again.json()["plan"]).hash() == plan.hash()

    theta = {p: initial_params(plan, p) for p in (0, 1)}
    for p in (0, 1):
        r = learners[0].init(p, theta[p])
        assert r.status_code == 200, r.text
        assert r.json() == {"fragment": p, "version": 0}
    again = learners[1].init(0, theta[0])
    assert again.status_code == 409
    assert again.json()["code"] == "already_initialised"

    fetched = learners[2].fetch(0)
    assert fetched is not None
    assert fetched[0] == 0
    np.testing.assert_array_equal(fetched[1]["wte.weight"], theta[0]["wte.weight"])

    # a long-poll for a version newer than 0 waits, and returns as soon as the round completes
    result: dict[str, object] = {}
    poller = threading.Thread(target=lambda: result.update(got=learners[2].fetch(0, newer_than=0, wait=30)))
    poller.start()
    grads = [outer_grad(plan, 0, seed=i) for i in range(3)]
    for i, learner in enumerate(learners):
        r = learner.contribute(0, 0, encode_grad(grads[i], 0, 0), steps=4, tokens=32)
        assert r.status_code == 202, r.text
        assert r.json()["status"] == "accepted"
    poller.join(timeout=30)
    got = result["got"]
    assert got is not None
    version, params = got  # type: ignore[misc]
    assert version == 1
    want = expected_after_round(theta[0], grads)
    for name in want:
        np.testing.assert_allclose(params[name], want[name], rtol=1e-5, atol=1e-6)

    # fragment 1 did not move; nothing newer arrives there within the wait
    assert learners[0].fetch(1, newer_than=0, wait=0.2) is None
    s = status(sync.url)
    assert s["rounds"] == 1
    assert [f["version"] for f in s["fragments"]] == [1, 0]  # type: ignore[index]
    assert s["recent_rounds"][0]["participants"] == ["l0", "l1", "l2"]  # type: ignore[index]
    assert {lr["learner_id"] for lr in s["learners"]} == {"l0", "l1", "l2"}  # type: ignore[union-attr]
    assert s["bytes_in"] > 0
    assert s["bytes_out"] > 0
    metrics = httpx.get(f"{sync.url}/metrics").text
    assert 'diloco_sync_rounds_total{fragment="0"} 1.0' in metrics
    assert 'diloco_sync_contributions_total{result="accepted"} 3.0' in metrics
    assert httpx.get(f"{sync.url}/readyz").json()["ready"] is True


@pytest.fixture(scope="module")
def no_init_sync(module_sync_factory: SyncFactory) -> SyncProcess:
    """A synchronizer of ``ARGS`` shared by the tests that initialise no fragment and register no
    learner but "a": the learner list holds "a" alone, whichever of them ran first."""
    return module_sync_factory(args=ARGS)


def test_plan_mismatch_and_heartbeat(no_init_sync: SyncProcess) -> None:
    sync = no_init_sync
    plan = tiny_plan()
    a = Learner(sync.url, "a", plan)
    assert a.register().status_code == 200
    other = Learner(sync.url, "b", tiny_plan(inner_steps=4, overlap=2))
    r = other.register()
    assert r.status_code == 409
    assert r.json()["code"] == "plan_mismatch"
    # the setting is named, with both values
    assert (
        "overlap: the job's 1, this learner's 2 (overlap (--overlap, spec.diloco.overlap))"
        in r.json()["reason"]
    )
    hb = a.heartbeat(12, eval_loss=3.5)
    assert hb.status_code == 200
    assert hb.json() == {"versions": {"0": -1, "1": -1}, "alive_learners": 1}
    learners = status(sync.url)["learners"]
    assert learners == [
        {**learners[0], "learner_id": "a", "step": 12, "eval_loss": 3.5, "alive": True, "state": "training"}  # type: ignore[index]
    ]
    assert a.client.post("/v1/learners/a/leave").status_code == 204
    assert status(sync.url)["learners"][0]["state"] == "left"  # type: ignore[index]


def test_openapi_lists_the_protocol_routes(no_init_sync: SyncProcess) -> None:
    sync = no_init_sync
    doc = httpx.get(f"{sync.url}/openapi.json").json()
    paths = doc["paths"]
    assert set(paths) >= {
        "/v1/learners/register", "/v1/learners/{learner_id}/heartbeat", "/v1/learners/{learner_id}/leave",
        "/v1/fragments/{p}/init", "/v1/fragments/{p}/contributions", "/v1/fragments/{p}", "/v1/status",
    }  # fmt: skip
    contrib = paths["/v1/fragments/{p}/contributions"]["post"]
    assert {p["name"] for p in contrib["parameters"]} >= {"p", "base_version", "steps", "tokens", "seq"}
    assert "application/octet-stream" in contrib["requestBody"]["content"]
    assert {"202", "400", "409", "413"} <= set(contrib["responses"])
    assert "X-DiLoCo-Learner" in {p["name"] for p in contrib["parameters"]}

    # every learner route declares the signed request (its scheme's name); the public routes declare none
    schemes = doc["components"]["securitySchemes"]
    assert len(schemes) == 1
    ((name, scheme),) = schemes.items()
    assert scheme["type"] == "http"
    assert scheme["scheme"] == "DiLoCo-Proof"
    learner_routes = [
        ("/v1/learners/register", "post"), ("/v1/learners/{learner_id}/heartbeat", "post"),
        ("/v1/learners/{learner_id}/leave", "post"), ("/v1/fragments/{p}/init", "put"),
        ("/v1/fragments/{p}/contributions", "post"), ("/v1/fragments/{p}", "get"),
    ]  # fmt: skip
    for path, method in learner_routes:
        operation = paths[path][method]
        assert operation["security"] == [{name: []}], path
        assert "X-DiLoCo-Learner" in {p["name"] for p in operation["parameters"]}, path
        assert "401" in operation["responses"], path
    for path in ("/healthz", "/readyz", "/metrics", "/v1/status"):
        assert "security" not in paths[path]["get"], path
    assert "security" not in doc  # no global requirement that would cover the public routes

    # binary bodies, both ways, and the headers of a fetched fragment
    binary = {"type": "string", "format": "binary"}
    init = paths["/v1/fragments/{p}/init"]["put"]
    assert init["requestBody"]["content"]["application/octet-stream"]["schema"] == binary
    assert contrib["requestBody"]["content"]["application/octet-stream"]["schema"] == binary
    fetched = paths["/v1/fragments/{p}"]["get"]["responses"]
    assert fetched["200"]["content"]["application/octet-stream"]["schema"] == binary
    assert set(fetched["200"]["headers"]) == {"X-DiLoCo-Version", "X-DiLoCo-Fragment"}
    assert fetched["200"]["headers"]["X-DiLoCo-Version"]["schema"] == {"type": "integer"}
    assert "X-DiLoCo-Round-Open" in fetched["204"]["headers"]
    assert "X-DiLoCo-Fragment" in fetched["304"]["headers"]
    register = paths["/v1/learners/register"]["post"]["responses"]["200"]["content"]["application/json"]
    ref = register["schema"]["$ref"].rsplit("/", 1)[-1]
    assert {"plan", "plan_hash"} <= set(doc["components"]["schemas"][ref]["properties"])

    # the paths are the protocol's constants, and its fragment maps declare the keys they take
    assert {API_PREFIX + path for path in (REGISTER_PATH, HEARTBEAT_PATH, LEAVE_PATH, INIT_PATH,
            CONTRIBUTIONS_PATH, FRAGMENT_PATH, STATUS_PATH)} <= set(paths)  # fmt: skip
    schemas = doc["components"]["schemas"]
    for model, field in (("RegisterResponse", "versions"), ("HeartbeatResponse", "versions"),
                         ("Heartbeat", "fragment_steps"), ("Heartbeat", "fragment_tokens")):  # fmt: skip
        declared = schemas[model]["properties"][field]
        assert declared["propertyNames"]["pattern"] == FRAGMENT_KEY_PATTERN, (model, field)
        assert declared["additionalProperties"] is False, (model, field)
    heartbeat = schemas["Heartbeat"]["properties"]
    assert heartbeat["step_time_s"]["maximum"] == MAX_STEP_TIME_S
    assert "400" in paths["/v1/learners/{learner_id}/heartbeat"]["post"]["responses"]
