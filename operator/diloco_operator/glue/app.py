"""The operator's process: kopf started with the handlers of ``handlers`` and this operator's
settings in kopf's memo (``memo.settings``), where the handlers read them."""

from __future__ import annotations

import asyncio
import datetime
import getpass
import logging
import os
import secrets
import socket

import kopf

from diloco_operator.settings import OperatorSettings


def own_identity() -> str:
    """This replica's name among its peers: the pod's (``POD_ID``), else user@host with the start time
    and a random suffix, so that two replicas on one host differ."""
    pod = os.environ.get("POD_ID")
    if pod:
        return pod
    now = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d%H%M%S")
    return f"{getpass.getuser()}@{socket.gethostname()}/{now}/{secrets.token_hex(2)}"


def run(settings: OperatorSettings) -> None:
    import diloco_operator.glue.handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=settings.verbose)
    logging.getLogger("diloco_operator").setLevel(logging.DEBUG if settings.verbose else logging.INFO)
    # kopf says "Handler ... succeeded" at INFO for every watch event (thousands for a big job's
    # pods); its failures are warnings and errors. Peering and start-up keep their INFO lines.
    logging.getLogger("kopf.objects").setLevel(logging.DEBUG if settings.verbose else logging.WARNING)
    identity = own_identity()  # kept in the memo too, so liveness can tell itself from its peers
    namespaces = list(settings.namespace)
    asyncio.run(
        kopf.operator(
            identity=identity,  # type: ignore[arg-type]  # kopf types it as a NewType of str it does not export
            clusterwide=not namespaces,
            namespaces=namespaces,
            liveness_endpoint=settings.liveness or None,
            peering_name=None if settings.standalone else settings.peering,
            standalone=settings.standalone,
            priority=settings.priority,
            memo=kopf.Memo(settings=settings, namespaces=namespaces, identity=identity),
        )
    )
