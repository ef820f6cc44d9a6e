"""The inner AdamW against torch.optim.AdamW: the same parameters bit for bit, the same state dict."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from diloco_core.config import ModelSettings, TrainSettings
from diloco_worker.adamw import AdamW
from diloco_worker.model import build_gpt, lm_loss
from diloco_worker.train import make_optimizer
from torch import nn

TINY = ModelSettings(n_layer=1, n_head=2, n_embd=16, block_size=8)
CFG = TrainSettings(lr=3e-3, weight_decay=0.1)


def groups(model: nn.Module) -> list[dict[str, object]]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def reference(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(groups(model), lr=CFG.lr, betas=(CFG.beta1, CFG.beta2), foreach=False)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x = torch.randint(0, 256, (4, TINY.block_size), generator=gen)
        for group in opt.param_groups:
            group["lr"] = CFG.lr * (1 + step % 7) / 7  # a schedule changes lr between steps
        lm_loss(model, (x, x.roll(1, dims=1))).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name


def test_it_updates_parameters_exactly_as_torch_adamw() -> None:
    mine, theirs = build_gpt(TINY), build_gpt(TINY)
    train(mine, make_optimizer(mine, CFG), range(40))
    train(theirs, reference(theirs), range(40))
    assert_same(mine, theirs)


def test_its_state_dict_has_torch_adamw_layout_and_values() -> None:
    mine, theirs = build_gpt(TINY), build_gpt(TINY)
    ours, ref = make_optimizer(mine, CFG), reference(theirs)
    train(mine, ours, range(5))
    train(theirs, ref, range(5))
    a, b = ours.state_dict(), ref.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for number, values in a["state"].items():
        assert values.keys() == b["state"][number].keys()
        for key, tensor in values.items():
            assert torch.equal(tensor, b["state"][number][key]), (number, key)


@pytest.mark.parametrize("direction", ["torch to ours", "ours to torch"])
def test_a_state_saved_by_one_resumes_in_the_other_exactly(direction: str) -> None:
    first, second, straight = build_gpt(TINY), build_gpt(TINY), build_gpt(TINY)
    train(straight, make_optimizer(straight, CFG), range(20))
    opt_a: torch.optim.Optimizer = (
        reference(first) if direction == "torch to ours" else make_optimizer(first, CFG)
    )
    train(first, opt_a, range(10))
    second.load_state_dict(first.state_dict())
    opt_b: torch.optim.Optimizer = (
        make_optimizer(second, CFG) if direction == "torch to ours" else reference(second)
    )
    opt_b.load_state_dict(opt_a.state_dict())
    train(second, opt_b, range(10, 20))
    assert_same(second, straight)


def test_the_first_step_and_a_state_round_trip_import_no_compiler() -> None:
    code = (
        "import sys, torch\n"
        "from diloco_worker.adamw import AdamW\n"
        "p = torch.nn.Parameter(torch.ones(3))\n"
        "opt = AdamW([p], lr=0.1)\n"
        "p.sum().backward(); opt.step(); opt.zero_grad(); opt.load_state_dict(opt.state_dict())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "False"


def test_bad_settings_and_shared_parameters_are_refused() -> None:
    p = nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="invalid AdamW settings"):
        AdamW([p], lr=-1.0)
    with pytest.raises(ValueError, match="more than one place"):
        AdamW([{"params": [p]}, {"params": [p]}])
    opt = AdamW([p])
    with pytest.raises(ValueError, match="another layout"):
        opt.load_state_dict({"state": {}, "param_groups": []})


def test_zero_grad_can_keep_the_tensors() -> None:
    p = nn.Parameter(torch.ones(2))
    opt = AdamW([p])
    p.sum().backward()
    opt.zero_grad(set_to_none=False)
    assert p.grad is not None
    assert torch.equal(p.grad, torch.zeros(2))
