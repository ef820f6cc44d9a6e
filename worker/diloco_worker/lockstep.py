"""Where a learner that (re)joins a synchronous job (``--blocking-sync``) stands in the round cycle.

With blocking sync every learner contributes the fragments in the same cyclic order: fragment ``p``
is due at the steps ``offset_p + k * H`` and its ``k``-th round needs every learner's ``k``-th
contribution. A learner that joins late or resumes from an older checkpoint must take the next
contribution that the others wait for; taking them in another order would leave two learners each
waiting for the other's fragment (a deadlock). The global versions say how many rounds each fragment
has merged; from them follows the step counter each fragment should have now (pure arithmetic).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from diloco_core.fragments import FragmentPlan


def lockstep_counters(plan: FragmentPlan, versions: Mapping[int, int]) -> dict[int, int]:
    """Steps since the last sync for every fragment (negative: not started yet), given the fragments'
    global versions (version ``v`` = ``v`` rounds merged since the initial version 0).

    The job stands just after its newest merge: at step ``L = max(offset_p + rounds_p * H)`` over the
    fragments that merged at least once (0 when none has). Fragment ``p``'s next round closes at
    ``offset_p + (rounds_p + 1) * H``, so its counter is ``H`` minus the steps still to go."""
    h = plan.inner_steps
    rounds = {f.index: max(0, versions.get(f.index, 0)) for f in plan.fragments}
    merged = [f.offset + rounds[f.index] * h for f in plan.fragments if rounds[f.index] > 0]
    now = max(merged, default=0)
    return {f.index: h - (f.offset + (rounds[f.index] + 1) * h - now) for f in plan.fragments}


FINISHED_STATES = frozenset({"leaving", "left"})


def round_can_close(learner_states: Iterable[str], quorum: int) -> bool:
    """Whether the learners that have not left the job can still fill a round of ``quorum``.

    A dead learner still counts (it is restarted and rejoins: the others wait for it, as synchronous
    DiLoCo does); a learner that finished and left never contributes again, so waiting for a round
    that needs it would never end."""
    members = sum(1 for state in learner_states if state not in FINISHED_STATES)
    return members >= quorum
