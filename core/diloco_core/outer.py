"""The outer optimizer of one fragment: SGD with (optionally delayed) Nesterov momentum, in float32.

Plain Nesterov follows ``torch.optim.SGD(nesterov=True)``: ``u ← μu + Δ; θ ← θ - η(Δ + μu)``.

Delayed Nesterov (Async Local-SGD, Alg. 3 with c = 0; docs/algorithm.md §2.3, §3.8), for small quorums that
produce many one-learner merges: outer gradients are summed in a buffer ``B``; every N-th step
``u ← μu + B/N`` and ``θ ← θ - η(μu + Δ/N)``; on the other steps ``θ ← θ - ηΔ/N`` and ``u`` is kept.

Alg. 3 applies one worker's outer gradient per step. A merge of k learners (quorum or grace window)
counts here as k steps whose outer gradient is the merged Δ: ``B += kΔ``, ``θ -= η·kΔ/N``, and the
momentum is applied when the step counter crosses a multiple of N. So the cadence stays once per
N contributions however they are grouped, and a merge of all N learners at once is exactly one
plain Nesterov step on Δ (synchronous DiLoCo).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
_STEP_KEY = "__step__"
_MOMENTUM = "momentum/"
_BUFFER = "delayed/"


class OuterOptimizer:
    """Per-tensor momentum keyed by tensor name; state created on first use."""

    def __init__(self, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True, delayed_every: int = 0):
        if not lr > 0 or not 0 <= momentum < 1 or delayed_every < 0:
            raise ValueError(
                f"bad outer optimizer settings lr={lr} momentum={momentum} delayed_every={delayed_every}"
            )
        self.lr = lr
        self.momentum = momentum
        self.nesterov = nesterov
        self.delayed_every = delayed_every
        self.steps = 0
        self._u: dict[str, F32] = {}
        self._buf: dict[str, F32] = {}

    def step(
        self,
        params: Mapping[str, npt.NDArray[np.floating]],
        delta: Mapping[str, npt.NDArray[np.floating]],
        count: int = 1,
    ) -> dict[str, F32]:
        """New parameters from the current ones and the merged outer gradient ``Δ = θ - θ_local``
        of ``count`` contributions (used by Delayed Nesterov only; plain Nesterov takes one step)."""
        if count < 1:
            raise ValueError(f"count must be at least 1, not {count}")
        if set(params) != set(delta):
            raise ValueError(f"params and delta name different tensors: {sorted(set(params) ^ set(delta))}")
        for name in params:
            if np.shape(params[name]) != np.shape(delta[name]):
                raise ValueError(
                    f"tensor {name!r}: params {np.shape(params[name])} vs delta {np.shape(delta[name])}"
                )
        if self.delayed_every:
            out = self._delayed(params, delta, count)
            self.steps += count
        else:
            out = {
                n: self._nesterov(n, np.asarray(params[n], np.float32), np.asarray(delta[n], np.float32))
                for n in params
            }
            self.steps += 1
        return out

    def _nesterov(self, name: str, p: F32, d: F32) -> F32:
        mu, lr = np.float32(self.momentum), np.float32(self.lr)
        u = self._u.get(name)
        u = d.copy() if u is None else u * mu + d
        self._u[name] = u
        g = d + mu * u if self.nesterov else u
        return p - lr * g

    def _delayed(
        self,
        params: Mapping[str, npt.NDArray[np.floating]],
        delta: Mapping[str, npt.NDArray[np.floating]],
        count: int,
    ) -> dict[str, F32]:
        n = self.delayed_every
        mu, lr, inv_n = np.float32(self.momentum), np.float32(self.lr), np.float32(1.0 / n)
        apply_momentum = (self.steps + count) // n > self.steps // n
        out: dict[str, F32] = {}
        for name in params:
            p = np.asarray(params[name], np.float32)
            d: F32 = np.asarray(delta[name], np.float32) * np.float32(count)
            buf: F32 = self._buf.get(name, np.zeros_like(p)) + d
            if apply_momentum:
                u = self._u.get(name, np.zeros_like(p)) * mu + buf * inv_n
                self._u[name] = u
                out[name] = (p - lr * (mu * u + d * inv_n)).astype(np.float32, copy=False)
                self._buf[name] = np.zeros_like(p)
            else:
                out[name] = (p - lr * (d * inv_n)).astype(np.float32, copy=False)
                self._buf[name] = buf
        return out

    def state_arrays(self) -> dict[str, F32]:
        """The state as float32 arrays (``momentum/NAME``, ``delayed/NAME``, ``__step__``)."""
        state = {_MOMENTUM + n: u.copy() for n, u in self._u.items()}
        state.update({_BUFFER + n: b.copy() for n, b in self._buf.items()})
        # float32 counts outer steps exactly up to 2**24, far beyond any run's number of rounds
        state[_STEP_KEY] = np.array([self.steps], dtype=np.float32)
        return state

    def load_state_arrays(self, d: Mapping[str, npt.NDArray[np.floating]]) -> None:
        """Restore what ``state_arrays`` returned; raises ``ValueError`` on unknown keys."""
        u: dict[str, F32] = {}
        buf: dict[str, F32] = {}
        steps = 0
        for key, value in d.items():
            arr = np.array(value, dtype=np.float32)
            if key == _STEP_KEY:
                if arr.shape != (1,) or not arr[0] >= 0:
                    raise ValueError(f"bad outer optimizer step counter {arr!r}")
                steps = int(arr[0])
            elif key.startswith(_MOMENTUM):
                u[key[len(_MOMENTUM) :]] = arr
            elif key.startswith(_BUFFER):
                buf[key[len(_BUFFER) :]] = arr
            else:
                raise ValueError(f"unknown outer optimizer state key {key!r}")
        self._u, self._buf, self.steps = u, buf, steps
