"""The operator's own settings: flags of ``diloco operator`` and ``DILOCO_OPERATOR_*`` variables.

Every field is a flag (``--resync-seconds``) and a variable (``DILOCO_OPERATOR_RESYNC_SECONDS``),
derived by ``diloco_core.flags``; a flag wins over its variable. ``diloco operator`` hands them to the
handlers in kopf's memo (``diloco_operator.glue.app``); under ``kopf run`` the handlers read the
variables themselves (:func:`settings_from_env`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Annotated

from diloco_core.flags import Cli, SettingsError, derive_flags, read, unknown_variables, validate
from pydantic import BaseModel, ConfigDict, Field

PREFIX = "DILOCO_OPERATOR_"


class OperatorSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: Annotated[tuple[str, ...], Cli(short="-n")] = Field(
        (), description="watch only these namespaces (repeatable); default: all namespaces"
    )
    liveness: str = Field("http://0.0.0.0:8080/healthz", description="liveness endpoint URL ('' disables)")
    peering: str = Field(
        "diloco",
        description="name of the kopf peering object (the chart's default too, so an "
        "operator run by hand and the chart's pause for each other); created when missing",
    )
    priority: int = Field(0, description="peering priority of this replica")
    standalone: bool = Field(False, description="no peering: for a single replica or tests")
    verbose: Annotated[bool, Cli(short="-v")] = Field(False, description="debug logging")
    resync_seconds: float = Field(
        15.0,
        gt=0.0,
        description="interval of the timer that repairs drift, reads the synchronizers' status and "
        "drives chaos (the status follows the pods as they change, not this timer)",
    )
    apply_concurrency: int = Field(16, ge=1, le=256, description="children of a job applied at once")
    metrics_port: int = Field(9090, ge=0, le=65535, description="Prometheus metrics port; 0 disables")
    status_timeout_seconds: float = Field(2.0, gt=0.0, description="timeout of GET /v1/status calls")
    sync_url: str | None = Field(
        None,
        description="override of the synchronizer URL the operator reads status from; "
        "'{name}' and '{namespace}' are replaced (for operators running outside the cluster)",
    )
    watch_stale_seconds: float = Field(
        60.0,
        gt=0.0,
        description="liveness fails once the API has held a job version that the watch has not "
        "delivered for this long",
    )
    sync_network_policy: bool = Field(
        True,
        description="give each job's synchronizer pods a NetworkPolicy that admits only the job's "
        "learners and the operator's namespace; --no-sync-network-policy deletes them",
    )
    operator_namespace: str | None = Field(
        None,
        description="the namespace this operator runs in, admitted by those NetworkPolicies (for "
        "status polling; the chart sets it); unset: an operator outside the cluster",
    )
    allow_chaos: bool = Field(False, description="let jobs with spec.chaos.enabled kill their learner pods")
    chaos_seed: int | None = Field(
        None, description="seed of the chaos random generator (reproducible game days)"
    )


FLAGS = derive_flags(OperatorSettings, {"": None}, env_prefix=PREFIX)


def parse_settings(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> OperatorSettings:
    """Flags in ``args`` over ``DILOCO_OPERATOR_*``; raises ``SettingsError`` naming the flag or variable
    (also for a variable that is no setting: a misspelt one would be ignored otherwise)."""
    source = os.environ if environ is None else environ
    unknown = unknown_variables(FLAGS, source, PREFIX)
    if unknown:
        raise SettingsError(f"invalid operator settings: {', '.join(unknown)}: no such setting")
    return validate(OperatorSettings, read(FLAGS, args, source), what="operator settings")


def settings_from_env(environ: Mapping[str, str] | None = None) -> OperatorSettings:
    """The settings from ``DILOCO_OPERATOR_*`` alone; a bad value raises ValueError naming the variable."""
    return parse_settings(argparse.Namespace(), environ)
