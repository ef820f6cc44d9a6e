"""A deterministic, in-process, virtual-clock harness: M learners of the built-in byte-level GPT.

Every learner is a real PyTorch model with its own AdamW and data shard; what is simulated is only
time. Each inner step takes ``speed_factor x (1 + noise x N(0, 1))`` virtual seconds; events (step
boundaries, grace deadlines) are processed in virtual-time order, so a run depends only on its seed.
Everything DiLoCo comes from ``diloco_core``: the fragment plan, outer gradients, the wire codec
(bytes on the wire are the real encoded sizes), token weights, RDA/mean merging, the outer optimizer
and the round policy (``rounds.add_contribution`` / ``rounds.decide`` with the grace window).

The learners follow the worker's protocol (``diloco_worker.fragment_state``): a fragment is pushed
when it falls due (H steps since its last global version, offsets staggered), training goes on,
and any newer global version is applied (overwritten, alpha = 0) at the next step boundary.
As in the service, a round opens at its first contribution; with ``Method.partial`` it then pulls
the other learners (``diloco_worker.pull``): every learner whose base version is the round's, with
at least one step on it and nothing sent since, sends its partial outer gradient at its next step
boundary; the boundaries before the grace deadline come first in virtual time, so those join the
round. Blocking modes (synchronous DiLoCo, K = all) make a learner wait after a push until the
merged version comes back; that waiting is the idle time that goodput counts as lost.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from diloco_core import codec, rounds
from diloco_core.config import ModelSettings, TrainSettings
from diloco_core.fragments import FragmentPlan, build_plan
from diloco_core.learner import outer_gradient
from diloco_core.merge import contribution_weight, merge_fragment
from diloco_core.outer import OuterOptimizer
from diloco_worker.data import BatchStream, Shard, eval_batches, load_corpus, split_corpus
from diloco_worker.model import EMBEDDING_NAMES, build_gpt, lm_loss
from diloco_worker.pull import should_send_partial
from diloco_worker.train import autocast_for, lr_at, make_optimizer
from torch import nn

from diloco_bench import plots

Arrays = dict[str, np.ndarray]
WIRE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Workload:
    """The model, the data and the inner optimisation (the same for every method)."""

    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64
    batch_size: int = 8
    lr: float = 2e-3
    warmup_steps: int = 20
    corpus: str = "stdlib"
    corpus_bytes: int = 2_000_000
    eval_batches: int = 8
    device: str = "cpu"  # where every learner and the data-parallel model train (bf16 autocast on CUDA)


@dataclass(frozen=True)
class Method:
    """How the learners cooperate. ``quorum = 0`` means all learners (K = M)."""

    name: str
    kind: Literal["dp", "diloco"] = "diloco"
    learners: int = 4
    inner_steps: int = 16
    fragments: int = 4
    overlap: int = 2
    quorum: int = 1
    grace_gamma: float = 0.5
    grace_cap_steps: float = 1.0
    codec: str = "int4"
    merge_rule: Literal["rda", "mean"] = "rda"
    token_weighting: bool = True
    blocking: bool = False
    outer_lr: float = 0.7
    outer_momentum: float = 0.5  # 0.9 in the papers' long runs; 0.5 does better over ~8 outer steps
    max_staleness: int = 4
    dp_wire: str = "fp32"
    # an open round pulls the partial progress of the other learners (never in blocking modes); off by
    # default so that the experiments measured without it keep their figures; ``hetero`` turns it on
    partial: bool = False


def data_parallel(learners: int = 4, wire: str = "fp32") -> Method:
    return Method(f"data-parallel ({wire})", kind="dp", learners=learners, dp_wire=wire)


def diloco_sync(learners: int = 4, inner_steps: int = 16, wire: str = "fp32") -> Method:
    """Synchronous DiLoCo: K = M, P = 1, tau = 0, plain mean, learners wait for every merge."""
    return Method(
        f"DiLoCo sync ({wire})", learners=learners, inner_steps=inner_steps, fragments=1, overlap=0,
        quorum=0, grace_gamma=0.0, codec=wire, merge_rule="mean", token_weighting=False, blocking=True,
    )  # fmt: skip


def decoupled(learners: int = 4, wire: str = "int4", **kw: object) -> Method:
    """Decoupled DiLoCo: K = 1 + grace, token weights, RDA, P = 4 fragments, tau = 2."""
    return replace(Method(f"decoupled ({wire})", learners=learners, codec=wire), **kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Timing:
    steps: int = 160  # inner steps per learner (ends the run unless time_budget ends it first)
    speed_factors: tuple[float, ...] = ()  # step-time multiplier per learner (default all 1.0)
    noise: float = 0.0  # relative std of each step time
    time_budget: float = math.inf  # virtual seconds

    def factor(self, m: int) -> float:
        return self.speed_factors[m] if m < len(self.speed_factors) else 1.0


@dataclass
class RunResult:
    method: str
    seed: int
    eval_loss: float
    tokens: int
    virtual_time: float
    goodput: float  # busy / (busy + idle) learner-time
    merged_share: float  # learner-steps that reached the global model through a merge / all steps
    bytes_up: list[int]  # per learner, outer gradients or gradients sent
    peak_up: list[int]  # per learner, most bytes sent at one step boundary
    bytes_down: int  # global fragments delivered to learners, all learners
    steps: list[int]
    rounds: int = 0
    participants: float = 0.0  # mean learners per merge
    norm_ratios: list[float] = field(default_factory=list)  # ||merged|| / mean ||delta_m|| (>= 2 merged)
    wall_s: float = 0.0
    partials: int = 0  # partial outer gradients sent because a round asked for them

    @property
    def bytes_per_token(self) -> float:
        return sum(self.bytes_up) / max(self.tokens, 1)


def model_settings(w: Workload, seed: int) -> ModelSettings:
    return ModelSettings(n_layer=w.n_layer, n_head=w.n_head, n_embd=w.n_embd, block_size=w.block_size, seed=seed)


def train_settings(w: Workload, steps: int) -> TrainSettings:
    return TrainSettings(batch_size=w.batch_size, lr=w.lr, warmup_steps=w.warmup_steps, max_steps=max(steps, 1))


class Corpus:
    """The byte corpus loaded once and split into training bytes and held-out batches."""

    def __init__(self, w: Workload) -> None:
        train, held = split_corpus(load_corpus(w.corpus, w.corpus_bytes), 0.02)
        self.train = train
        self.held_out = eval_batches(held, batch_size=16, block_size=w.block_size, max_batches=w.eval_batches,
                                     device=torch.device(w.device))  # fmt: skip

    def stream(self, w: Workload, m: int, count: int, seed: int, batch_size: int | None = None) -> BatchStream:
        return BatchStream(
            self.train, Shard(m, count, "bench"), batch_size=batch_size or w.batch_size,
            block_size=w.block_size, seed=seed, device=torch.device(w.device),
        )  # fmt: skip


@torch.no_grad()
def evaluate(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    with autocast_for(batches[0][0].device):
        loss = statistics.fmean(float(lm_loss(model, b)) for b in batches)
    model.train()
    return loss


def to_numpy(model: nn.Module) -> Arrays:
    return {n: p.detach().cpu().float().numpy().copy() for n, p in model.named_parameters()}


@torch.no_grad()
def load_params(model: nn.Module, values: Arrays) -> None:
    params = dict(model.named_parameters())
    for name, v in values.items():
        params[name].copy_(torch.from_numpy(np.asarray(v, dtype=np.float32)))


def inner_step(model: nn.Module, opt: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor],
               step: int, cfg: TrainSettings) -> None:  # fmt: skip
    for group in opt.param_groups:
        group["lr"] = lr_at(step, cfg)
    with autocast_for(batch[0].device):
        loss = lm_loss(model, batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()


def step_time(rng: np.random.Generator, factor: float, noise: float) -> float:
    return factor * max(0.5, 1.0 + noise * float(rng.standard_normal())) if noise else factor


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
    while step < timing.steps and now < timing.time_budget:
        parts = [next(s) for s in streams]
        batch = (torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))
        inner_step(model, opt, batch, step, cfg)
        times = [step_time(r, timing.factor(m), timing.noise) for m, r in enumerate(rngs)]
        slowest = max(times)
        busy, idle, now, step = busy + sum(times), idle + sum(slowest - t for t in times), now + slowest, step + 1
    tokens = step * method.learners * w.batch_size * w.block_size
    M = method.learners
    return RunResult(
        method.name, seed, evaluate(model, corpus.held_out), tokens, now, busy / max(busy + idle, 1e-9),
        1.0, [grad_bytes * step] * M, [grad_bytes] * M, grad_bytes * step * M, [step] * M,
        wall_s=time.perf_counter() - started,
    )  # fmt: skip


@dataclass
class Pending:
    learner: int
    base_version: int
    steps: int
    tokens: int
    tensors: Arrays


class Syncer:
    """The synchronizer's merge path with the real round policy, in virtual time."""

    def __init__(self, method: Method, plan: FragmentPlan, params: Arrays) -> None:
        self.method, self.plan = method, plan
        self.global_params = {n: v.copy() for n, v in params.items()}
        P = len(plan.fragments)
        self.versions = [0] * P
        self.optimizers = [OuterOptimizer(method.outer_lr, method.outer_momentum) for _ in range(P)]
        self.pending: list[dict[int, Pending]] = [{} for _ in range(P)]
        self.state: list[rounds.RoundState | None] = [None] * P
        self.deadlines: list[float | None] = [None] * P
        self.quorum = method.quorum or method.learners
        self.step_time = 1.0
        self.rounds = 0
        self.participants = 0
        self.merged_steps = 0.0  # learner-steps, weighted by the fragment's share of the model
        self.norm_ratios: list[float] = []

    def fragment(self, p: int) -> Arrays:
        return {n: self.global_params[n] for n in self.plan.fragments[p].names}

    def submit(self, p: int, c: Pending, now: float) -> tuple[int, Arrays] | None:
        self.pending[p][c.learner] = c
        self._add(p, c, now)
        return self.consider(p, now)

    def consider(self, p: int, now: float) -> tuple[int, Arrays] | None:
        """Merge fragment ``p`` if the round policy says so; returns the new (version, values)."""
        state = self.state[p]
        if state is None:
            return None
        m = self.method
        d = rounds.decide(
            state, now=now, quorum=self.quorum, alive=m.learners, step_time=self.step_time, sync_time=0.0,
            overlap=m.overlap, gamma=m.grace_gamma, cap=m.grace_cap_steps * self.step_time,
            max_staleness=m.max_staleness,
        )  # fmt: skip
        if d.excluded:
            for learner, _ in d.excluded:
                self.pending[p].pop(int(learner), None)
            self.state[p] = rounds.open_round(p, self.versions[p], state.opened_at)
            for c in self.pending[p].values():
                self._add(p, c, state.opened_at)
        if d.action == "wait":
            self.deadlines[p] = d.deadline
            return None
        return self._merge(p, [self.pending[p].pop(int(n)) for n in d.participants])

    def flush(self, p: int) -> tuple[int, Arrays] | None:
        """At the end of a run: merge whatever fresh contributions are pending, quorum or not."""
        fresh = [c for c in self.pending[p].values()
                 if not rounds.is_stale(c.base_version, self.versions[p], self.method.max_staleness)]  # fmt: skip
        self.pending[p] = {}
        return self._merge(p, sorted(fresh, key=lambda c: c.learner))

    def _add(self, p: int, c: Pending, now: float) -> None:
        state = self.state[p] or rounds.open_round(p, self.versions[p], now)
        entry = rounds.Contribution(str(c.learner), c.base_version, c.steps, c.tokens, now)
        self.state[p] = rounds.add_contribution(state, entry, quorum=self.quorum, max_staleness=self.method.max_staleness)

    def _merge(self, p: int, contribs: list[Pending]) -> tuple[int, Arrays] | None:
        self.deadlines[p], self.state[p] = None, None
        if not contribs:
            return None
        m, frag = self.method, self.plan.fragments[p]
        weights = [
            contribution_weight(c.tokens, c.steps, token_weighting=m.token_weighting,
                                staleness=rounds.staleness(c.base_version, self.versions[p]))
            for c in contribs
        ]  # fmt: skip
        deltas = [c.tensors for c in contribs]
        merged = merge_fragment(deltas, weights, rule=m.merge_rule, kind=frag.kind)
        if len(contribs) > 1 and frag.kind == "dense":
            mean_norm = statistics.fmean(_norm(d) for d in deltas)
            if mean_norm > 0:
                self.norm_ratios.append(_norm(merged) / mean_norm)
        new = self.optimizers[p].step(self.fragment(p), merged)
        self.global_params.update(new)
        self.versions[p] += 1
        self.rounds += 1
        self.participants += len(contribs)
        self.merged_steps += sum(c.steps for c in contribs) * frag.numel / self.plan.num_params
        return self.versions[p], new


def _norm(arrays: Arrays) -> float:
    return math.sqrt(sum(float(np.dot(v.ravel().astype(np.float64), v.ravel().astype(np.float64))) for v in arrays.values()))


@dataclass
class Counter:
    """The worker's per-fragment counter (``diloco_worker.fragment_state.FragmentCounter``)."""

    base_version: int = 0
    steps: int = 0
    tokens: int = 0
    sent_at: int = 0


class SimLearner:
    """One learner: a real model, optimizer and shard; its clock and idle time are virtual."""

    def __init__(self, m: int, method: Method, w: Workload, timing: Timing, corpus: Corpus, plan: FragmentPlan,
                 seed: int) -> None:  # fmt: skip
        self.index, self.method, self.plan = m, method, plan
        self.model = build_gpt(model_settings(w, seed)).to(w.device)
        self.cfg = train_settings(w, timing.steps)
        self.opt = make_optimizer(self.model, self.cfg)
        self.stream = corpus.stream(w, m, method.learners, seed)
        self.rng = np.random.default_rng([seed, m])
        self.factor, self.noise = timing.factor(m), timing.noise
        self.tokens_per_step = w.batch_size * w.block_size
        params = to_numpy(self.model)
        self.anchors = [{n: params[n].copy() for n in f.names} for f in plan.fragments]
        self.counters = [Counter(steps=-f.offset) for f in plan.fragments]
        self.inbox: dict[int, tuple[float, int, Arrays]] = {}
        self.clock = self.busy = self.idle = 0.0
        self.steps = 0
        self.stepped = False  # a step ended at ``clock`` whose counters are not yet advanced
        self.waiting_since: float | None = None
        self.bytes_up, self.peak_up, self.bytes_down = 0, 0, 0

    def fragment_params(self, p: int) -> Arrays:
        named = dict(self.model.named_parameters())
        return {n: named[n].detach().cpu().float().numpy().copy() for n in self.plan.fragments[p].names}

    def deliver(self, p: int, version: int, values: Arrays, at: float, nbytes: int) -> None:
        self.inbox[p] = (at, version, values)
        self.bytes_down += nbytes

    def apply_arrivals(self) -> None:
        for p in sorted(self.inbox):
            at, version, values = self.inbox[p]
            if at <= self.clock and version > self.counters[p].base_version:
                del self.inbox[p]
                load_params(self.model, values)
                self.anchors[p] = {n: v.copy() for n, v in values.items()}
                self.counters[p] = Counter(base_version=version)

    def advance(self) -> None:
        if self.stepped:
            for c in self.counters:
                c.steps += 1
                if c.steps > 0:
                    c.tokens += self.tokens_per_step
            self.stepped = False

    def due(self) -> list[int]:
        H = self.plan.inner_steps
        return [p for p, c in enumerate(self.counters) if c.steps > 0 and c.steps - c.sent_at >= H]

    def contribution(self, p: int) -> tuple[Pending, int]:
        """The outer gradient of fragment ``p`` through the real codec; (decoded, bytes on the wire)."""
        c = self.counters[p]
        c.sent_at = c.steps
        delta = outer_gradient(self.anchors[p], self.fragment_params(p))
        blob = codec.encode(delta, fragment=p, base_version=c.base_version, kind="outer_grad", quantizer=self.method.codec)
        decoded = codec.decode(blob, fragment=self.plan.fragments[p]).tensors
        return Pending(self.index, c.base_version, c.steps, c.tokens, decoded), len(blob)

    def train_step(self) -> float:
        inner_step(self.model, self.opt, next(self.stream), self.steps, self.cfg)
        dt = step_time(self.rng, self.factor, self.noise)
        self.steps += 1
        self.busy += dt
        self.clock += dt
        self.stepped = True
        return dt


class DiLoCoRun:
    """The event loop: learner step boundaries and grace deadlines, in virtual-time order."""

    def __init__(self, method: Method, w: Workload, timing: Timing, corpus: Corpus, seed: int) -> None:
        torch.manual_seed(seed)
        self.method, self.timing, self.seed = method, timing, seed
        probe = build_gpt(model_settings(w, seed))
        shapes = [(n, tuple(p.shape)) for n, p in probe.named_parameters()]
        emb = [n for n, _ in shapes if n in EMBEDDING_NAMES]
        self.plan = build_plan(shapes, method.fragments, method.inner_steps, method.overlap, embedding_names=emb)
        self.syncer = Syncer(method, self.plan, to_numpy(probe))
        self.learners = [SimLearner(m, method, w, timing, corpus, self.plan, seed) for m in range(method.learners)]
        self.heap: list[tuple[float, int]] = [(0.0, m) for m in range(method.learners)]
        self.step_times: list[float] = []
        self.partials = 0

    def run(self) -> None:
        while True:
            deadline = min(((d, p) for p, d in enumerate(self.syncer.deadlines) if d is not None), default=None)
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
            for p, c in enumerate(ln.counters):
                if c.steps > c.sent_at and c.steps > 0:
                    self.send(ln, p, end, push_only=True)
        for p in range(len(self.plan.fragments)):
            self.syncer.flush(p)

    def boundary(self, ln: SimLearner, now: float) -> None:
        ln.clock = now
        ln.advance()
        ln.apply_arrivals()
        due = ln.due()
        if self.method.blocking and due:
            ln.waiting_since = now  # released (and rescheduled) by publish() once the merge comes back
        asked = self.asked(ln) if self.method.partial and not self.method.blocking else []
        self.partials += len(asked)
        ln.peak_up = max(ln.peak_up, sum(self.send(ln, p, now) for p in [*due, *asked]))
        if self.method.blocking and due:
            return
        if ln.steps >= self.timing.steps or now >= self.timing.time_budget:
            return
        dt = ln.train_step()
        self.step_times.append(dt)
        self.syncer.step_time = statistics.fmean(self.step_times[-64:])
        heapq.heappush(self.heap, (ln.clock, ln.index))

    def asked(self, ln: SimLearner) -> list[int]:
        """The fragments whose open round pulls this learner's partial progress now (the worker's rule)."""
        out = []
        for p, state in enumerate(self.syncer.state):
            c = ln.counters[p]
            if state is not None and ln.index not in self.syncer.pending[p] and should_send_partial(
                requested_version=state.version, base_version=c.base_version, steps=c.steps,
                sent_at=c.sent_at, pending=False,
            ):  # fmt: skip
                out.append(p)
        return out

    def send(self, ln: SimLearner, p: int, now: float, push_only: bool = False) -> int:
        contribution, nbytes = ln.contribution(p)
        ln.bytes_up += nbytes
        if push_only:
            self.syncer.pending[p][ln.index] = contribution
        else:
            self.publish(p, self.syncer.submit(p, contribution, now), now)
        return nbytes

    def publish(self, p: int, merged: tuple[int, Arrays] | None, now: float) -> None:
        """Deliver a new global version to every learner; release the ones blocked on it."""
        if merged is None:
            return
        version, values = merged
        nbytes = len(codec.encode(values, fragment=p, base_version=version, kind="params", quantizer="fp32"))
        for ln in self.learners:
            ln.deliver(p, version, values, now, nbytes)
            if ln.waiting_since is not None and all(
                ln.counters[q].sent_at == 0 or q in ln.inbox for q in range(len(self.plan.fragments))
            ):
                ln.idle += now - ln.waiting_since
                ln.waiting_since = None
                heapq.heappush(self.heap, (now, ln.index))

    def result(self, w: Workload, corpus: Corpus, started: float) -> RunResult:
        model = build_gpt(model_settings(w, self.seed)).to(w.device)
        load_params(model, self.syncer.global_params)
        lns, s = self.learners, self.syncer
        busy, idle = sum(ln.busy for ln in lns), sum(ln.idle for ln in lns)
        steps = [ln.steps for ln in lns]
        return RunResult(
            self.method.name, self.seed, evaluate(model, corpus.held_out), sum(steps) * w.batch_size * w.block_size,
            max(ln.clock for ln in lns), busy / max(busy + idle, 1e-9), s.merged_steps / max(sum(steps), 1),
            [ln.bytes_up for ln in lns], [ln.peak_up for ln in lns], sum(ln.bytes_down for ln in lns), steps,
            rounds=s.rounds, participants=s.participants / max(s.rounds, 1), norm_ratios=list(s.norm_ratios),
            wall_s=time.perf_counter() - started, partials=self.partials,
        )  # fmt: skip


def run(method: Method, w: Workload, timing: Timing, corpus: Corpus, seed: int) -> RunResult:
    """One run of ``method``; deterministic in (method, workload, timing, seed)."""
    torch.set_num_threads(1)
    if method.kind == "dp":
        return run_data_parallel(method, w, timing, corpus, seed)
    started = time.perf_counter()
    sim = DiLoCoRun(method, w, timing, corpus, seed)
    sim.run()
    return sim.result(w, corpus, started)


# ---- shared by the experiment modules: flags, statistics, tables ----


def parser(prog: str, description: str | None, *, steps: int, seeds: str = "0") -> argparse.ArgumentParser:
    """The flags every experiment takes; the defaults are sized for 2 CPU cores."""
    d = Workload()
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--steps", type=int, default=steps, help="inner steps per learner (default %(default)s)")
    p.add_argument("--seeds", default=seeds, help="comma-separated seeds (default %(default)s)")
    p.add_argument("--n-layer", type=int, default=d.n_layer)
    p.add_argument("--n-head", type=int, default=d.n_head)
    p.add_argument("--n-embd", type=int, default=d.n_embd)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per learner step")
    p.add_argument("--lr", type=float, default=d.lr, help="inner AdamW peak learning rate")
    p.add_argument("--corpus", default=d.corpus, help="'stdlib' or a local file/folder")
    p.add_argument("--device", default=d.device, help="cpu or cuda: where every learner and the data-parallel "
                   "baseline train (bf16 autocast on CUDA)")
    p.add_argument("--outer-lr", type=float, default=Method.outer_lr, help="outer SGD learning rate")
    p.add_argument("--outer-momentum", type=float, default=Method.outer_momentum, help="outer Nesterov momentum")
    output_flags(p)
    return p


def output_flags(p: argparse.ArgumentParser, *, plot: bool = True) -> None:
    """The outputs every benchmark shares: ``--json PATH`` and (``plot``) ``--plot-dir`` / ``--no-plot``."""
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this file")
    if plot:
        plots.add_flags(p)


def workload_from(a: argparse.Namespace) -> Workload:
    return Workload(
        n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd, block_size=a.block_size,
        batch_size=a.batch_size, lr=a.lr, corpus=a.corpus, device=a.device,
    )  # fmt: skip


def with_outer(methods: Sequence[Method], a: argparse.Namespace) -> list[Method]:
    """The DiLoCo methods with the outer optimizer of the flags."""
    return [replace(m, outer_lr=a.outer_lr, outer_momentum=a.outer_momentum) for m in methods]


def check_inner_steps(p: argparse.ArgumentParser, inner_steps: int) -> None:
    """Decoupled runs use P = 4 fragments with distinct offsets and overlap 2: H must be at least 4."""
    if inner_steps < Method.fragments:
        p.error(f"--inner-steps must be at least {Method.fragments} (one offset per fragment), got {inner_steps}")


def seeds_from(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        raise SystemExit(f"--seeds must be comma-separated integers, got {text!r}") from exc
    if not seeds:
        raise SystemExit("--seeds names no seed")
    return seeds


def mean_std(values: Sequence[float], digits: int = 3) -> str:
    if len(values) < 2:
        return f"{values[0]:.{digits}f}" if values else "-"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Path | None, payload: object) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")


def _jsonable(o: object) -> object:
    if isinstance(o, RunResult):
        return asdict(o)
    raise TypeError(f"cannot write {type(o).__name__} as JSON")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} GB"
