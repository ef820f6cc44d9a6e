"""With K = M, P = 1, tau = 0, alpha = 0 and equal speeds the library is synchronous DiLoCo.

The reference is the DiLoCo paper's Algorithm 1 written plainly in torch: M replicas start each round
from the global model, take H AdamW steps on their own batches, the outer gradient is the mean of
``global - local``, and torch's own SGD(nesterov=True) takes the outer step. The library path goes
through the fragment plan, the learners' fragment counters, the fp32 codec, the round policy, and the
round pipeline the synchronizer runs (``round_math.merge_round``: token weights, the mean merge,
the outer optimizer).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from diloco_core import codec
from diloco_core.config import DiLoCoSettings
from diloco_core.fragments import build_plan
from diloco_core.learner import FragmentCounters, apply_global, outer_gradient
from diloco_core.merge import check_finite
from diloco_core.outer import OuterState
from diloco_core.round_math import merge_round
from diloco_core.rounds import RoundEntry, add_contribution, decide, open_round
from torch import nn

M, H, ROUNDS, BATCH, CTX, VOCAB = 3, 4, 4, 8, 6, 64
TEXT = torch.tensor(list(Path(__file__).read_bytes()), dtype=torch.long) % VOCAB


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, 16)
        self.h = nn.ModuleList([nn.Linear(16 * CTX, 32), nn.Linear(32, VOCAB)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.wte(x).flatten(1)
        return self.h[1](torch.tanh(self.h[0](e)))


def batch(replica: int, rnd: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rnd + 100 * replica + step)
    starts = torch.randint(0, len(TEXT) - CTX - 1, (BATCH,), generator=g)
    x = torch.stack([TEXT[s : s + CTX] for s in starts])
    y = torch.stack([TEXT[s + CTX] for s in starts])
    return x, y


def inner_step(model: nn.Module, opt: torch.optim.Optimizer, replica: int, rnd: int, step: int) -> None:
    x, y = batch(replica, rnd, step)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def new_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def reference_diloco(init: nn.Module) -> list[dict[str, np.ndarray]]:
    global_model = copy.deepcopy(init)
    replicas = [copy.deepcopy(init) for _ in range(M)]
    inner = [new_adamw(r) for r in replicas]
    outer = torch.optim.SGD(global_model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    history = []
    for rnd in range(ROUNDS):
        for m, replica in enumerate(replicas):
            replica.load_state_dict(global_model.state_dict())
            for step in range(H):
                inner_step(replica, inner[m], m, rnd, step)
        for name, p in global_model.named_parameters():
            locals_ = [dict(r.named_parameters())[name].detach() for r in replicas]
            p.grad = torch.stack([p.detach() - q for q in locals_]).mean(0)
        outer.step()
        history.append({n: p.detach().numpy().copy() for n, p in global_model.named_parameters()})
    return history


@dataclass(frozen=True)
class Received:
    """A contribution as the synchronizer holds it: the decoded outer gradient and its metadata."""

    base_version: int
    steps: int
    tokens: int
    tensors: Mapping[str, np.ndarray]


def to_numpy(model: nn.Module) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def load(model: nn.Module, values: dict[str, np.ndarray]) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.from_numpy(values[n]))


def library_diloco(init: nn.Module) -> list[dict[str, np.ndarray]]:
    shapes = [(n, tuple(p.shape)) for n, p in init.named_parameters()]
    plan = build_plan(shapes, num_fragments=1, inner_steps=H, overlap=0, embedding_names={"wte.weight"})
    frag = plan.fragments[0]
    settings = DiLoCoSettings(
        fragments=1, inner_steps=H, overlap=0, quorum=M, outer_lr=0.7, outer_momentum=0.9,
        merge_rule="mean", max_staleness=0, codec="fp32", error_feedback=False, down_codec="fp32",
        outer_warmup=0,
    )  # fmt: skip
    theta, outer, version = to_numpy(init), OuterState(), 0
    replicas = [copy.deepcopy(init) for _ in range(M)]
    inner = [new_adamw(r) for r in replicas]
    counters = [FragmentCounters(plan) for _ in range(M)]
    for c in counters:
        c.set_base(0, version)
    history = []
    for rnd in range(ROUNDS):
        state = open_round(fragment=0, version=version, now=float(rnd))
        blobs = {}
        for m, replica in enumerate(replicas):
            load(replica, apply_global(to_numpy(replica), theta, alpha=0.0))
            anchor = dict(theta)
            for step in range(H):
                inner_step(replica, inner[m], m, rnd, step)
                counters[m].advance(tokens=BATCH * CTX)
            assert counters[m].due() == [0]
            sent = counters[m].mark_sent(0)
            delta = outer_gradient(anchor, to_numpy(replica))
            blobs[f"learner-{m}"] = codec.encode(
                delta, fragment=0, base_version=sent.base_version, kind="outer_grad", quantizer=settings.codec
            )
            contribution = RoundEntry(f"learner-{m}", sent.base_version, sent.steps, sent.tokens, rnd + 0.5)
            state = add_contribution(state, contribution, quorum=M, max_staleness=0)
        decision = decide(
            state,
            now=rnd + 0.5,
            quorum=M,
            alive=M,
            step_time=1.0,
            sync_time=0.0,
            overlap=0,
            gamma=0.5,
            cap=1.0,
        )
        assert decision.action == "merge"
        assert len(decision.participants) == M
        received = []
        for name in decision.participants:
            payload = codec.decode(blobs[name], fragment=frag)
            assert check_finite(payload.tensors) is None
            meta = state.pending[name]
            received.append(Received(meta.base_version, meta.steps, meta.tokens, payload.tensors))
        result = merge_round(frag, theta, outer, version, received, settings)
        theta, outer, version = result.params, result.outer, result.version
        for c in counters:
            c.reset(0, version)
        history.append(dict(theta))
    return history


@pytest.mark.slow
def test_library_reduces_to_synchronous_diloco() -> None:
    torch.manual_seed(0)
    init = TinyLM()
    reference = reference_diloco(init)
    library = library_diloco(init)
    for rnd, (ref, lib) in enumerate(zip(reference, library, strict=True)):
        for name in ref:
            np.testing.assert_allclose(
                lib[name], ref[name], rtol=1e-5, atol=1e-6, err_msg=f"round {rnd} {name}"
            )
    # the model did move: the comparison is not between two unchanged initialisations
    start = to_numpy(init)
    assert max(float(np.abs(reference[-1][n] - start[n]).max()) for n in start) > 1e-2
