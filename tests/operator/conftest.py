"""Fixtures of the operator's cluster tests: the CRDs installed, an operator running in-process."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from kopf.testing import KopfRunner
from kubernetes import client as k8s

# Read when diloco_operator.glue.handlers is imported (kopf needs the timer interval then).
os.environ["DILOCO_OPERATOR_RESYNC_SECONDS"] = "2"
os.environ.setdefault("DILOCO_OPERATOR_METRICS_PORT", "0")
# Most tests run no synchronizer (kwok pods have no containers): a closed local port fails at once.
os.environ.setdefault("DILOCO_OPERATOR_SYNC_URL", "http://127.0.0.1:9")

import diloco_operator.glue.handlers  # noqa: F401  (registers the handlers)

from tests.operator.kubejobs import install_crds, start_operator


@pytest.fixture(scope="module")
def api(kube: Any) -> Iterator[k8s.ApiClient]:
    with kube.api_client() as api_client:
        install_crds(api_client)
        yield api_client


@pytest.fixture
def operator(api: k8s.ApiClient) -> Iterator[KopfRunner]:
    with start_operator() as runner:
        yield runner
    assert runner.exception is None, runner.output
