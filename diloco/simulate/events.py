"""The discrete-event core: one job (non-elastic) or one elastic learner, simulated over a horizon.

Groups of chips are the units: a job of n chips fails at rate n / MTBI, an elastic learner is k
slices that each fail at rate (chips per slice) / MTBI while they train. Random draws are made in
bulk with numpy from a ``numpy.random.Generator`` passed in (so a seed fixes the result); the
elastic learner's state machine then walks the merged event stream once.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from diloco.simulate.model import SimParams


@dataclass(frozen=True)
class Tally:
    """Chip-seconds of one simulated group over the horizon.

    ``paused_s`` is the time the whole group made no progress; ``pauses`` (elastic learners only)
    holds those disjoint intervals as an (n, 2) array of [start, end) seconds.
    """

    useful_chip_s: float
    allocated_chip_s: float
    failures: int
    paused_s: float
    pauses: np.ndarray = field(default_factory=lambda: np.empty((0, 2)), compare=False, repr=False)

    @property
    def goodput(self) -> float:
        return self.useful_chip_s / self.allocated_chip_s if self.allocated_chip_s > 0 else 1.0


def _arrivals(rate: float, horizon: float, rng: np.random.Generator) -> np.ndarray:
    """Poisson arrival times in [0, horizon) at ``rate`` per second, drawn in bulk."""
    if rate <= 0 or horizon <= 0:
        return np.empty(0)
    chunks: list[np.ndarray] = []
    start = 0.0
    expected = rate * horizon
    while start < horizon:
        size = int(expected + 6 * math.sqrt(expected) + 16)
        times = start + np.cumsum(rng.exponential(1.0 / rate, size))
        chunks.append(times)
        start = float(times[-1])
    times = np.concatenate(chunks)
    return times[times < horizon]


def simulate_restart_job(chips: int, params: SimParams, horizon: float, rng: np.random.Generator) -> Tally:
    """Data-parallel without elasticity: every failure restarts the job from its last checkpoint.

    The job alternates up-time U ~ Exp(chips / MTBI) and a restart R ~ ``params.restart``. Progress
    is checkpointed every ``checkpoint_interval_s`` of up-time, so a failure keeps
    ``U - (U mod interval)``. Fully vectorised: cycles are drawn in bulk and cut at the horizon,
    where the work in flight counts as kept.
    """
    allocated = chips * horizon
    rate = chips / params.mtbi_s
    if rate == 0 or horizon <= 0:
        return Tally(allocated, allocated, 0, 0.0)
    expected = horizon / (1.0 / rate + params.restart.mean())
    ups_list: list[np.ndarray] = []
    downs_list: list[np.ndarray] = []
    elapsed = 0.0
    while elapsed < horizon:
        size = int(expected + 6 * math.sqrt(expected) + 16)
        ups = rng.exponential(1.0 / rate, size)
        downs = params.restart.sample(rng, size)
        ups_list.append(ups)
        downs_list.append(downs)
        elapsed += float(ups.sum() + downs.sum())
    ups = np.concatenate(ups_list)
    downs = np.concatenate(downs_list)
    ends = np.cumsum(ups + downs)
    starts = ends - ups - downs
    full = ends <= horizon
    interval = params.checkpoint_interval_s
    kept = ups[full] - np.mod(ups[full], interval) if interval > 0 else ups[full]
    useful = float(kept.sum())
    paused = float(downs[full].sum())
    last = int(full.sum())
    failures = last
    if last < len(ups):  # the cycle the horizon cuts through
        into = horizon - float(starts[last])
        useful += min(into, float(ups[last]))
        paused += max(0.0, into - float(ups[last]))
        failures += int(into > ups[last])
    return Tally(useful * chips, allocated, failures, paused)


@dataclass(frozen=True)
class _Draws:
    times: np.ndarray
    accept: np.ndarray
    repairs: np.ndarray


def _elastic_draws(
    slices: int, slice_chips: float, params: SimParams, horizon: float, rng: np.random.Generator
) -> _Draws:
    # Candidate failures at the rate of all slices; a candidate hits a training slice with
    # probability (training slices / all slices) -- thinning keeps each slice's rate exact.
    times = _arrivals(slices * slice_chips / params.mtbi_s, horizon, rng)
    return _Draws(times, rng.random(len(times)) * slices, params.slice_repair.sample(rng, len(times)))


def simulate_elastic_learner(
    chips: float, params: SimParams, horizon: float, rng: np.random.Generator
) -> Tally:
    """An elastic data-parallel job (also one decoupled learner) of ``chips`` chips.

    The job is k = max(1, round(chips / slice_chips)) equal slices. A failure of a training slice
    pauses the job for ``t_down_s`` (unless a pause is already running: then it is absorbed) and
    sends the slice to repair; a repaired slice waits for admission, which happens at most once per
    ``admit_window_s`` and pauses the job for ``t_up_s`` (absorbed likewise). Useful chip-time is
    the training slices' chips times the un-paused time.
    """
    slices = max(1, round(chips / params.slice_chips))
    slice_chips = chips / slices
    allocated = chips * horizon
    draws = _elastic_draws(slices, slice_chips, params, horizon, rng)
    times, accept, repairs = draws.times.tolist(), draws.accept.tolist(), draws.repairs.tolist()
    t_down, t_up, window = params.t_down_s, params.t_up_s, params.admit_window_s
    inf = math.inf
    up, waiting, failures = slices, 0, 0
    pause_end, last_admit, admit_at = 0.0, -inf, inf
    t_prev, useful, paused = 0.0, 0.0, 0.0
    returns: list[float] = []
    pauses: list[float] = []
    i, n = 0, len(times)
    while True:
        tf = times[i] if i < n else inf
        tr = returns[0] if returns else inf
        t = min(tf, tr, admit_at, horizon)
        live_from = max(t_prev, pause_end)
        if t > live_from:
            useful += up * (t - live_from)
        paused += min(t, pause_end) - t_prev if pause_end > t_prev else 0.0
        t_prev = t
        if t >= horizon:
            break
        if t == admit_at:
            up, waiting, last_admit, admit_at = up + waiting, 0, t, inf
            if t >= pause_end:
                pause_end = t + t_up
                pauses += (t, pause_end)
        elif t == tr:
            heapq.heappop(returns)
            waiting += 1
            if admit_at == inf:
                admit_at = max(t, last_admit + window)
        else:
            if accept[i] < up:
                up -= 1
                failures += 1
                heapq.heappush(returns, t + repairs[i])
                if t >= pause_end:
                    pause_end = t + t_down
                    pauses += (t, pause_end)
            i += 1
    intervals = np.minimum(np.array(pauses).reshape(-1, 2), horizon)
    return Tally(useful * slice_chips, allocated, failures, paused, intervals)


def all_paused_seconds(pauses: list[np.ndarray]) -> float:
    """Time during which every group is paused at once, given each group's disjoint intervals."""
    if not pauses or any(len(p) == 0 for p in pauses):
        return 0.0
    bounds = np.concatenate([np.concatenate([p[:, 0], p[:, 1]]) for p in pauses])
    steps = np.concatenate([np.concatenate([np.ones(len(p)), -np.ones(len(p))]) for p in pauses])
    order = np.lexsort((steps, bounds))  # at equal times, ends (-1) before starts (+1)
    bounds, depth = bounds[order], np.cumsum(steps[order])
    all_in = depth[:-1] == len(pauses)
    return float(np.sum(np.diff(bounds)[all_in]))
