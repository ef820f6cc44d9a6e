"""One simulated learner: a real model, optimizer and data shard, the learner's own fragment
counters (``diloco_core.learner.FragmentCounters``, as the worker counts) and the real codec; only
its clock and idle time are virtual."""

from __future__ import annotations

import numpy as np
from diloco_core import codec, downlink, feedback
from diloco_core.codec import encode_params
from diloco_core.fragments import FragmentPlan
from diloco_core.learner import FragmentCounters, outer_gradient
from diloco_worker.model import build_gpt
from diloco_worker.train import make_optimizer

from diloco_bench.runs import Method, Timing
from diloco_bench.syncer import Release, Upload
from diloco_bench.workload import (
    Arrays,
    Corpus,
    Workload,
    inner_step,
    load_params,
    model_settings,
    step_time,
    to_numpy,
    train_settings,
)


class SimLearner:
    def __init__(
        self,
        m: int,
        method: Method,
        w: Workload,
        timing: Timing,
        corpus: Corpus,
        plan: FragmentPlan,
        seed: int,
    ) -> None:
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
        self.counters = FragmentCounters(plan, schedule=method.settings.schedule)
        for f in plan.fragments:  # every learner starts from the global version 0
            self.counters.set_base(f.index, 0)
        self.inbox: dict[int, tuple[float, int, Arrays]] = {}
        self.known: list[tuple[int, Arrays]] = [(0, a) for a in self.anchors]  # latest global version held
        self.residuals: list[Arrays | None] = [None] * len(plan.fragments)  # error feedback, per fragment
        self.clock = self.busy = self.idle = 0.0
        self.steps = 0
        self.stepped = False  # a step ended at ``clock`` whose counters are not yet advanced
        self.waiting_since: float | None = None
        self.bytes_up, self.peak_up, self.bytes_down = 0, 0, 0

    def fragment_params(self, p: int) -> Arrays:
        named = dict(self.model.named_parameters())
        return {n: named[n].detach().cpu().float().numpy().copy() for n in self.plan.fragments[p].names}

    def deliver(self, p: int, release: Release, at: float) -> None:
        """Receive a new global version: a whole one, or an update the learner applies to its copy of
        the previous version (a full copy, counted as the synchronizer serves it, when it does not
        hold that version)."""
        if release.update:
            version, known = self.known[p]
            made = downlink.apply(version, known, release.blob, self.plan.fragments[p])
            if made is None:  # on demand: the whole version
                whole = encode_params(release.params, p, release.version)
                made, self.bytes_down = (release.version, dict(release.params)), self.bytes_down + len(whole)
            self.known[p] = made
        else:
            self.known[p] = (release.version, dict(release.params))
        self.bytes_down += len(release.blob)
        self.inbox[p] = (at, *self.known[p])

    def apply_arrivals(self) -> None:
        for p in sorted(self.inbox):
            at, version, values = self.inbox[p]
            if at <= self.clock and version > self.counters[p].base_version:
                del self.inbox[p]
                load_params(self.model, values)
                self.anchors[p] = {n: v.copy() for n, v in values.items()}
                self.counters.reset(p, version)

    def advance(self) -> None:
        if self.stepped:
            self.counters.advance(self.tokens_per_step)
            self.stepped = False

    def contribution(self, p: int) -> tuple[Upload, int]:
        """The outer gradient of fragment ``p`` through the real codec; (decoded, bytes on the wire)."""
        c = self.counters.mark_sent(p)
        params = self.fragment_params(p)
        delta = outer_gradient(self.anchors[p], params)
        self.anchors[p] = (
            params  # the next send before a new version carries only the progress after this one
        )
        if self.method.settings.error_feedback:
            enc = feedback.encode(
                delta,
                self.residuals[p],
                fragment=p,
                base_version=c.base_version,
                kind="outer_grad",
                quantizer=self.method.settings.codec,
                block_size=self.method.block_size,
                owned=True,
            )
            self.residuals[p], blob = enc.residual, enc.blob
        else:
            blob = codec.encode(
                delta,
                fragment=p,
                base_version=c.base_version,
                kind="outer_grad",
                quantizer=self.method.settings.codec,
                block_size=self.method.block_size,
            )
        decoded = codec.decode(blob, fragment=self.plan.fragments[p]).tensors
        return Upload(self.index, c, decoded), len(blob)

    def train_step(self) -> float:
        inner_step(self.model, self.opt, next(self.stream), self.steps, self.cfg)
        dt = step_time(self.rng, self.factor, self.noise)
        self.steps += 1
        self.busy += dt
        self.clock += dt
        self.stepped = True
        return dt
