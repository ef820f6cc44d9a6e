"""What the installed worker and synchronizer can do, checked before a run starts.

The synchronous baselines need support that a component may not have yet; the run refuses to
start with a clear message rather than run something that only looks like the baseline.
"""

from __future__ import annotations

import re

from diloco.runner.settings import RunSettings, SettingsError

BLOCKING_SYNC_FLAG = "--blocking-sync"


def worker_help() -> str:
    from diloco_worker.settings import build_parser

    text: str = build_parser().format_help()
    return text


def check_mode_supported(settings: RunSettings, help_text: str | None = None) -> None:
    """``diloco-sync`` needs learners that wait for every round (``--blocking-sync``); ``ddp`` runs the
    learners as the ranks of one torch.distributed unit, which the worker supports."""
    if settings.mode != "diloco-sync":
        return
    text = worker_help() if help_text is None else help_text
    if re.search(re.escape(BLOCKING_SYNC_FLAG) + r"(?![\w-])", text) is None:
        raise SettingsError(
            "--mode diloco-sync needs learners that block at every sync until the round's global version "
            f"arrives (worker flag {BLOCKING_SYNC_FLAG}), which this worker does not have; a learner "
            "that keeps training while a peer is down would not show what synchronous DiLoCo does"
        )
