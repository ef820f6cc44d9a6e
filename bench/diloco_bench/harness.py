"""A deterministic, in-process, virtual-clock harness: M learners of the built-in byte-level GPT.

Every learner is a real PyTorch model with its own AdamW and data shard; what is simulated is only
time. Each inner step takes ``speed_factor x (1 + noise x N(0, 1))`` virtual seconds; events (step
boundaries, grace deadlines) are processed in virtual-time order, so a run depends only on its seed.
Everything DiLoCo comes from ``diloco_core``: the fragment plan, the learners' fragment counters,
outer gradients, the wire codec (bytes on the wire are the real encoded sizes), the round policy
(``rounds.add_contribution`` / ``rounds.decide`` with the grace window) and the round pipeline the
synchronizer service runs (``round_math.merge_round``: token and staleness weights, RDA/mean merging,
Nesterov or Delayed Nesterov): see :mod:`.syncer` and :mod:`.sim_learner`.

The learners follow the worker's protocol (``diloco_core.learner.FragmentCounters``): a fragment is
pushed when it falls due (H steps since its last global version, offsets staggered), training goes
on, and any newer global version is applied (overwritten, alpha = 0) at the next step boundary.
As in the service, a round opens at its first contribution; with ``Method.partial`` it then pulls
the other learners (``diloco_worker.pull``): every learner whose base version is the round's, with
at least one step on it and nothing sent since, sends its partial outer gradient at its next step
boundary; the boundaries before the grace deadline come first in virtual time, so those join the
round. Blocking modes (synchronous DiLoCo, K = all) make a learner wait after a push until the
merged version comes back; that waiting is the idle time that goodput counts as lost.
"""

from __future__ import annotations

import heapq
import math
import statistics
import time

import numpy as np
import torch
from diloco_core.fragments import build_plan
from diloco_worker.model import EMBEDDING_NAMES, build_gpt
from diloco_worker.pull import should_send_partial
from diloco_worker.train import make_optimizer

from diloco_bench.runs import WIRE_BYTES, Method, RunResult, Timing
from diloco_bench.sim_learner import SimLearner
from diloco_bench.syncer import Release, Syncer
from diloco_bench.workload import (
    Corpus,
    Workload,
    evaluate,
    inner_step,
    load_params,
    model_settings,
    step_time,
    to_numpy,
    train_settings,
)


def run_data_parallel(method: Method, w: Workload, timing: Timing, corpus: Corpus, seed: int) -> RunResult:
    """M x batch per step, one model; every step waits for the slowest learner; a gradient per step."""
    started = time.perf_counter()
    torch.manual_seed(seed)
    model = build_gpt(model_settings(w, seed)).to(w.device)
    cfg = train_settings(w, timing.steps)
    opt = make_optimizer(model, cfg)
    streams = [corpus.stream(w, m, method.learners, seed) for m in range(method.learners)]
    rngs = [np.random.default_rng([seed, m]) for m in range(method.learners)]
    numel = sum(p.numel() for p in model.parameters())
    grad_bytes = numel * WIRE_BYTES[method.dp_wire]
    now = busy = idle = 0.0
    step = 0
    curve: list[tuple[int, float]] = []
    while step < timing.steps and now < timing.time_budget:
        parts = [next(s) for s in streams]
        batch = (torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))
        inner_step(model, opt, batch, step, cfg)
        times = [step_time(r, timing.factor(m), timing.noise) for m, r in enumerate(rngs)]
        slowest = max(times)
        busy, idle, now, step = (
            busy + sum(times),
            idle + sum(slowest - t for t in times),
            now + slowest,
            step + 1,
        )
        if timing.eval_every and step % timing.eval_every == 0 and step < timing.steps:
            curve.append(
                (step * method.learners * w.batch_size * w.block_size, evaluate(model, corpus.held_out))
            )
    tokens = step * method.learners * w.batch_size * w.block_size
    M = method.learners
    loss = evaluate(model, corpus.held_out)
    return RunResult(
        method.name,
        seed,
        loss,
        tokens,
        now,
        busy / max(busy + idle, 1e-9),
        1.0,
        [grad_bytes * step] * M,
        [grad_bytes] * M,
        grad_bytes * step * M,
        [step] * M,
        wall_s=time.perf_counter() - started,
        curve=[*curve, (tokens, loss)],
    )


class DiLoCoRun:
    """The event loop: learner step boundaries and grace deadlines, in virtual-time order."""

    def __init__(self, method: Method, w: Workload, timing: Timing, corpus: Corpus, seed: int) -> None:
        torch.manual_seed(seed)
        self.method, self.timing, self.seed = method, timing, seed
        self.w, self.corpus = w, corpus
        probe = build_gpt(model_settings(w, seed))
        shapes = [(n, tuple(p.shape)) for n, p in probe.named_parameters()]
        emb = [n for n, _ in shapes if n in EMBEDDING_NAMES]
        s = method.settings
        self.plan = build_plan(shapes, s.fragments, s.inner_steps, s.overlap, embedding_names=emb)
        self.syncer = Syncer(method.settings, method.learners, self.plan, to_numpy(probe), method.block_size)
        self.learners = [
            SimLearner(m, method, w, timing, corpus, self.plan, seed) for m in range(method.learners)
        ]
        self.heap: list[tuple[float, int]] = [(0.0, m) for m in range(method.learners)]
        self.step_times: list[float] = []
        self.partials = 0
        self.curve: list[tuple[int, float]] = []
        self.due_evals: list[tuple[float, int]] = []  # (virtual time a checkpoint was reached, tokens)
        self.learner_steps = 0

    def run(self) -> None:
        while True:
            deadline = min(
                ((d, p) for p, d in enumerate(self.syncer.deadlines) if d is not None), default=None
            )
            self.evaluate_due(
                min(self.heap[0][0] if self.heap else math.inf, deadline[0] if deadline else math.inf)
            )
            if self.heap and (deadline is None or self.heap[0][0] < deadline[0]):
                now, m = heapq.heappop(self.heap)
                self.boundary(self.learners[m], now)
            elif deadline is not None:
                self.syncer.deadlines[deadline[1]] = None
                self.publish(deadline[1], self.syncer.consider(deadline[1], deadline[0]), deadline[0])
            else:
                break
        end = max(ln.clock for ln in self.learners)
        for ln in self.learners:
            if ln.waiting_since is not None:
                ln.idle += max(min(end, self.timing.time_budget) - ln.waiting_since, 0.0)
            ln.clock = max(ln.clock, end)
        for ln in self.learners:  # final flush: every fragment with local progress is pushed and merged
            ln.advance()
            for p in range(len(ln.counters)):
                if ln.counters.unsent(p):
                    self.send(ln, p, end, push_only=True)
        for p in range(len(self.plan.fragments)):
            self.publish(p, self.syncer.flush(p, end), end)  # the learners receive the final version too

    def boundary(self, ln: SimLearner, now: float) -> None:
        ln.clock = now
        ln.advance()
        ln.apply_arrivals()
        due = ln.counters.due()
        if self.method.blocking and due:
            ln.waiting_since = now  # released (and rescheduled) by publish() once the merge comes back
        asked = self.asked(ln) if self.method.partial and not self.method.blocking else []
        asked = [p for p in asked if p not in due]  # a due fragment's send answers its round too
        self.partials += len(asked)
        ln.peak_up = max(ln.peak_up, sum(self.send(ln, p, now) for p in [*due, *asked]))
        if self.method.blocking and due:
            return
        if ln.steps >= self.timing.steps or now >= self.timing.time_budget:
            return
        dt = ln.train_step()
        self.learner_steps += 1
        every = self.timing.eval_every * self.method.learners
        if every and self.learner_steps % every == 0 and ln.steps < self.timing.steps:
            self.due_evals.append((ln.clock, self.learner_steps * ln.tokens_per_step))
        self.step_times.append(dt)
        self.syncer.step_time = statistics.fmean(self.step_times[-64:])
        heapq.heappush(self.heap, (ln.clock, ln.index))

    def asked(self, ln: SimLearner) -> list[int]:
        """The fragments whose open round pulls this learner's partial progress now (the worker's rule)."""
        out = []
        for p in range(len(self.plan.fragments)):
            c, requested = ln.counters[p], self.syncer.round_for(p, ln.index)
            if requested is not None and should_send_partial(
                requested_version=requested,
                base_version=c.base_version,
                steps=c.steps,
                sent_at=c.sent_at,
                pending=False,
            ):
                out.append(p)
        return out

    def send(self, ln: SimLearner, p: int, now: float, push_only: bool = False) -> int:
        contribution, nbytes = ln.contribution(p)
        ln.bytes_up += nbytes
        if push_only:
            self.syncer.queue(p, contribution, now)
        else:
            self.publish(p, self.syncer.submit(p, contribution, now), now)
        return nbytes

    def publish(self, p: int, release: Release | None, now: float) -> None:
        """Deliver a new global version to every learner; release the ones blocked on it."""
        if release is None:
            return
        for ln in self.learners:
            ln.deliver(p, release, now)
            if ln.waiting_since is not None and all(
                ln.counters[q].sent_at == 0 or q in ln.inbox for q in range(len(self.plan.fragments))
            ):
                ln.idle += now - ln.waiting_since
                ln.waiting_since = None
                heapq.heappush(self.heap, (now, ln.index))

    def evaluate_due(self, before: float) -> None:
        """Evaluate the global model for every checkpoint reached before virtual time ``before``: once
        every event at the checkpoint's time (the merges the steps up to it cause) has been processed."""
        while self.due_evals and self.due_evals[0][0] < before:
            _, tokens = self.due_evals.pop(0)
            self.curve.append((tokens, self.evaluate_global()))

    def evaluate_global(self) -> float:
        """Held-out loss of the global model as the synchronizer holds it now."""
        model = build_gpt(model_settings(self.w, self.seed)).to(self.w.device)
        load_params(model, self.syncer.global_params)
        return evaluate(model, self.corpus.held_out)

    def result(self, started: float) -> RunResult:
        w = self.w
        lns, s = self.learners, self.syncer
        busy, idle = sum(ln.busy for ln in lns), sum(ln.idle for ln in lns)
        steps = [ln.steps for ln in lns]
        tokens, loss = sum(steps) * w.batch_size * w.block_size, self.evaluate_global()
        return RunResult(
            self.method.name,
            self.seed,
            loss,
            tokens,
            max(ln.clock for ln in lns),
            busy / max(busy + idle, 1e-9),
            s.merged_steps / max(sum(steps), 1),
            [ln.bytes_up for ln in lns],
            [ln.peak_up for ln in lns],
            sum(ln.bytes_down for ln in lns),
            steps,
            rounds=s.rounds,
            refused=s.refused,
            participants=s.participants / max(s.rounds, 1),
            norm_ratios=list(s.norm_ratios),
            wall_s=time.perf_counter() - started,
            partials=self.partials,
            curve=[*self.curve, (tokens, loss)],
        )


def run(method: Method, w: Workload, timing: Timing, corpus: Corpus, seed: int) -> RunResult:
    """One run of ``method``; deterministic in (method, workload, timing, seed)."""
    torch.set_num_threads(1)
    if method.kind == "dp":
        return run_data_parallel(method, w, timing, corpus, seed)
    started = time.perf_counter()
    sim = DiLoCoRun(method, w, timing, corpus, seed)
    sim.run()
    return sim.result(started)
