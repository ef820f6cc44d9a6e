"""The operator's own settings, read once from the environment (``DILOCO_OPERATOR_*``)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

PREFIX = "DILOCO_OPERATOR_"


class OperatorSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    resync_seconds: float = Field(15.0, gt=0.0, description="interval of the drift-repair and status timer")
    metrics_port: int = Field(9090, ge=0, le=65535, description="Prometheus metrics port; 0 disables")
    status_timeout_seconds: float = Field(2.0, gt=0.0, description="timeout of GET /v1/status calls")
    sync_url: str | None = Field(
        None, description="override of the synchronizer URL the operator reads status from; "
        "'{name}' and '{namespace}' are replaced (for operators running outside the cluster)")
    watch_stale_seconds: float = Field(
        60.0, gt=0.0, description="liveness fails once the API has held a job version that the watch has not "
        "delivered for this long")
    allow_chaos: bool = Field(False, description="let jobs with spec.chaos.enabled kill their learner pods")
    chaos_seed: int | None = Field(None, description="seed of the chaos random generator (reproducible game days)")


def settings_from_env(environ: Mapping[str, str] | None = None) -> OperatorSettings:
    """Parse ``DILOCO_OPERATOR_*``; a bad value raises ValueError naming the variable."""
    source = os.environ if environ is None else environ
    values = {k[len(PREFIX):].lower(): v for k, v in source.items() if k.startswith(PREFIX) and v != ""}
    try:
        return OperatorSettings.model_validate(values)
    except ValidationError as exc:
        problems = "; ".join(f"{PREFIX}{str(e['loc'][0]).upper()}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"invalid operator settings: {problems}") from None
