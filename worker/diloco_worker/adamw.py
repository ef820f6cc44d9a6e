"""AdamW for the inner loop, without the cost of ``torch._dynamo`` at start-up.

``torch.optim.AdamW`` imports ``torch._dynamo`` (sympy, the compiler stack) the first time any of
its methods runs: its constructor, ``step``, ``zero_grad`` and ``state_dict`` are wrapped to
disable the compiler. That import is about 1 CPU-second, a third of what a learner process spends
before its first step, and the learner compiles nothing. This class is that optimizer's
single-tensor update (``foreach=False``), operation for operation, so it gives bit-identical
parameters; its ``state_dict`` has torch's layout and keys, so checkpoints load in either. A test
compares both over many steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

# the hyper-parameters torch.optim.AdamW keeps in each group (and so in checkpoints), with the values
# this single-tensor implementation supports
FIXED_OPTIONS: dict[str, Any] = {
    "amsgrad": False,
    "maximize": False,
    "foreach": False,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}


class AdamW(torch.optim.Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), as ``torch.optim.AdamW(foreach=False)``."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(
                f"invalid AdamW settings: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}"
            )
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, **FIXED_OPTIONS}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """A group of parameters with its own settings (the defaults fill the rest)."""
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        seen = {id(p) for group in self.param_groups for p in group["params"]}
        if any(id(p) in seen for p in params) or len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears in more than one place of the optimizer's groups")
        if not all(isinstance(p, Tensor) and p.is_leaf for p in params):
            raise TypeError("the optimizer takes leaf tensors only")
        self.param_groups.append({**self.defaults, **param_group, "params": params})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = float(group["lr"]), group["eps"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                _update(
                    param, param.grad, state, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=decay
                )
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.detach_()
                    param.grad.requires_grad_(False)
                    param.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """Torch's layout: parameters numbered in group order, state keyed by those numbers."""
        index: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            numbers = []
            for param in group["params"]:
                index.setdefault(id(param), len(index))
                numbers.append(index[id(param)])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": numbers})
        state = {index[id(p)]: values for p, values in self.state.items() if id(p) in index}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of ``torch.optim.AdamW`` (same parameter layout)."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups, strict=True)
        ):
            raise ValueError("the saved optimizer state has another layout of parameter groups")
        by_number = {
            number: param
            for s, g in zip(saved, self.param_groups, strict=True)
            for number, param in zip(s["params"], g["params"], strict=True)
        }
        self.state.clear()
        for number, values in state_dict["state"].items():
            param = by_number[int(number)]
            self.state[param] = {
                key: value if key == "step" else value.to(dtype=param.dtype, device=param.device)
                for key, value in values.items()
            }
        for s, g in zip(saved, self.param_groups, strict=True):
            g.update({k: v for k, v in s.items() if k != "params"})
            g["betas"] = tuple(g["betas"])
            g.update(FIXED_OPTIONS)


def _update(
    param: Tensor,
    grad: Tensor,
    state: dict[str, Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW update of one parameter: torch's ``_single_tensor_adam`` with decoupled weight decay,
    in the same order of operations (so the same rounding)."""
    exp_avg, exp_avg_sq, step_t = state["exp_avg"], state["exp_avg_sq"], state["step"]
    step_t += 1
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step = step_t.item()
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
