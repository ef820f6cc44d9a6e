"""How much progress a learner can have made on a version: no more steps than the time since that
version was made allows at the job's fastest plausible step (``--min-step-time-s``), or at its
unit's where the learner's token declares a slower one (the operator mints it from the unit's
``minStepTimeSeconds``; a learner cannot alter its token's claims).

A learner cannot have trained on a version before it existed, so the bound holds across restarts
(the versions' commit times are kept in the manifest) and needs nothing the learner reports.
"""

from __future__ import annotations

CLOCK_SLACK_S = 5.0  # between the clocks of the synchronizer's pods (a restart may move it)
KEPT_VERSIONS = 64  # commit times kept per fragment (beyond any staleness a round accepts)


def most_steps(committed_at: float, now: float, min_step_s: float, slack_steps: int) -> int:
    """The most steps a learner can have trained on a version committed at ``committed_at``."""
    elapsed = max(0.0, now - committed_at) + CLOCK_SLACK_S
    return slack_steps + int(elapsed / min_step_s)


JOB_BOUND = "the synchronizer's --min-step-time-s"
UNIT_BOUND = "its unit's minStepTimeSeconds, in its token"


def pace_for(job_min_step_s: float, unit_min_step_s: float | None) -> tuple[float, str]:
    """The fastest step a learner is held to, and what sets it: the job's, or its unit's (declared in
    its token) where that is slower. A faster unit pace loosens nothing."""
    if unit_min_step_s is not None and unit_min_step_s > job_min_step_s:
        return unit_min_step_s, UNIT_BOUND
    return job_min_step_s, JOB_BOUND


def pace_problem(
    learner_id: str,
    fragment: int,
    base_version: int,
    through: int,
    committed_at: float | None,
    now: float,
    *,
    min_step_s: float,
    slack_steps: int,
    bound: str = JOB_BOUND,
) -> str | None:
    """Why progress through step ``through`` on ``base_version`` is more than can have been trained
    since that version was committed (None: plausible, or the commit time is unknown, or no bound)."""
    if committed_at is None or min_step_s <= 0:
        return None
    most = most_steps(committed_at, now, min_step_s, slack_steps)
    if through <= most:
        return None
    return (
        f"learner {learner_id} claims {through} steps on version {base_version} of fragment {fragment}, "
        f"made {max(0.0, now - committed_at):.1f} s ago: more than the {most} a learner can have trained "
        f"since at {min_step_s:g} s per step ({bound})"
    )


def kept_times(times: dict[int, float], version: int, at: float) -> dict[int, float]:
    """``times`` with ``version`` committed at ``at``, the oldest beyond ``KEPT_VERSIONS`` dropped."""
    out = {v: t for v, t in times.items() if v > version - KEPT_VERSIONS}
    out[version] = at
    return out
