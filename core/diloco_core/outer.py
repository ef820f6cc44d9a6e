"""The outer optimizer of one fragment: SGD with (optionally delayed) Nesterov momentum, in float32.

Plain Nesterov follows ``torch.optim.SGD(nesterov=True)``: ``u ← μu + Δ; θ ← θ - η(Δ + μu)``.

Delayed Nesterov (Async Local-SGD, Alg. 3 with c = 0; docs/algorithm.md §2.3, §3.8), for small quorums that
produce many one-learner merges: outer gradients are summed in a buffer ``B``; every N-th step
``u ← μu + B/N`` and ``θ ← θ - η(μu + Δ/N)``; on the other steps ``θ ← θ - ηΔ/N`` and ``u`` is kept.

Alg. 3 applies one worker's outer gradient per step. A merge of k learners (quorum or grace window)
counts here as k steps whose outer gradient is the merged Δ: ``B += kΔ``, ``θ -= (η_1 + … + η_k)Δ/N``
(each step's own learning rate, which differs during the outer warm-up), and the momentum is
applied, with the rate of the step it falls on, when the step counter crosses a multiple of N. So the cadence stays once per
N contributions however they are grouped, and a merge of all N learners at once is exactly one
plain Nesterov step on Δ (synchronous DiLoCo).

The optimizer is functional: :meth:`OuterOptimizer.step` takes an :class:`OuterState` and returns
the new parameters and a new state, never editing the one it was given (its arrays are read-only),
so a step whose result is thrown away leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from diloco_core import compiled
from diloco_core.tensor_match import check_same_tensors

F32 = npt.NDArray[np.float32]
_STEP_KEY = "__step__"
_MOMENTUM = "momentum/"
_BUFFER = "delayed/"
_RESIDUAL = "downlink/"
_STEP_CHUNK = 1 << 16  # values of a tensor stepped at a time


def _frozen(a: F32) -> F32:
    a.flags.writeable = False
    return a


def _check_state_shapes(state: OuterState, params: Mapping[str, npt.NDArray[np.floating]]) -> None:
    """Refuses (``ValueError``) a state whose momentum or buffer of a tensor is not the tensor's shape:
    the step is elementwise, and its compiled loop reads the momentum as far as the tensor goes."""
    for kind, held in (("momentum", state.momentum), ("delayed buffer", state.buffer)):
        common = [name for name in held if name in params]  # a tensor without one yet gets a new one
        check_same_tensors({n: held[n] for n in common}, {n: params[n] for n in common}, (kind, "params"))


@dataclass(frozen=True)
class OuterState:
    """Per-tensor momentum ``u`` and Delayed Nesterov buffer ``B`` (created on first use), the
    number of outer steps taken (Delayed Nesterov counts every merged contribution as one), and with
    compressed downloads the residual: what the outer steps made that the published version does
    not carry yet (``diloco_core.downlink``; kept with this state so that a restart loses none of it)."""

    steps: int = 0
    momentum: Mapping[str, F32] = field(default_factory=dict)
    buffer: Mapping[str, F32] = field(default_factory=dict)
    residual: Mapping[str, F32] = field(default_factory=dict)

    def to_arrays(self) -> dict[str, F32]:
        """The state as float32 arrays (``momentum/NAME``, ``delayed/NAME``, ``downlink/NAME``,
        ``__step__``), for storage."""
        state = {_MOMENTUM + n: u for n, u in self.momentum.items()}
        state.update({_BUFFER + n: b for n, b in self.buffer.items()})
        state.update({_RESIDUAL + n: r for n, r in self.residual.items()})
        # float32 counts outer steps exactly up to 2**24, far beyond any run's number of rounds
        state[_STEP_KEY] = np.array([self.steps], dtype=np.float32)
        return state

    @classmethod
    def from_arrays(cls, d: Mapping[str, npt.NDArray[np.floating]], *, given: bool = False) -> OuterState:
        """The state that :meth:`to_arrays` wrote; raises ``ValueError`` on unknown keys. The arrays
        are copied, unless ``given``: the caller hands them over (arrays just decoded, which nothing
        else holds), and float32 ones are kept as they are, made read-only, instead of copied."""
        u: dict[str, F32] = {}
        buf: dict[str, F32] = {}
        residual: dict[str, F32] = {}
        steps = 0
        for key, value in d.items():
            # np.require, not ascontiguousarray: the state of a 0-d tensor keeps its shape ()
            arr = _frozen(np.require(value, np.float32, "C") if given else np.array(value, dtype=np.float32))
            if key == _STEP_KEY:
                if arr.shape != (1,) or not arr[0] >= 0:
                    raise ValueError(f"bad outer optimizer step counter {arr!r}")
                steps = int(arr[0])
            elif key.startswith(_MOMENTUM):
                u[key[len(_MOMENTUM) :]] = arr
            elif key.startswith(_BUFFER):
                buf[key[len(_BUFFER) :]] = arr
            elif key.startswith(_RESIDUAL):
                residual[key[len(_RESIDUAL) :]] = arr
            else:
                raise ValueError(f"unknown outer optimizer state key {key!r}")
        return cls(steps, u, buf, residual)


@dataclass(frozen=True)
class OuterOptimizer:
    """The outer optimizer's settings; :meth:`step` maps (state, parameters, Δ) to new ones."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    delayed_every: int = 0
    warmup: int = 0  # the learning rate rises linearly to ``lr`` over this many steps of the state

    def __post_init__(self) -> None:
        if not self.lr > 0 or not 0 <= self.momentum < 1 or self.delayed_every < 0 or self.warmup < 0:
            raise ValueError(
                f"bad outer optimizer settings lr={self.lr} momentum={self.momentum} "
                f"delayed_every={self.delayed_every} warmup={self.warmup}"
            )

    def lr_at(self, steps: int) -> np.float32:
        """The learning rate of the step after ``steps`` earlier ones: ``lr * (steps + 1) / warmup``
        during the warm-up, ``lr`` after it (and always without one)."""
        if steps >= self.warmup:
            return np.float32(self.lr)
        return np.float32(self.lr * (steps + 1) / self.warmup)

    def step(
        self,
        state: OuterState,
        params: Mapping[str, npt.NDArray[np.floating]],
        delta: Mapping[str, npt.NDArray[np.floating]],
        count: int = 1,
    ) -> tuple[dict[str, F32], OuterState]:
        """New parameters and state from the current ones and the merged outer gradient
        ``Δ = θ - θ_local`` of ``count`` contributions (used by Delayed Nesterov only; plain
        Nesterov takes one step). ``state`` is left as it was."""
        if count < 1:
            raise ValueError(f"count must be at least 1, not {count}")
        check_same_tensors(params, delta, ("params", "delta"))
        _check_state_shapes(state, params)
        if self.delayed_every:
            return self._delayed(state, params, delta, count)
        momentum = dict(state.momentum)
        out: dict[str, F32] = {}
        for n in params:
            out[n], momentum[n] = self._nesterov(
                state.momentum.get(n),
                np.asarray(params[n], np.float32),
                np.asarray(delta[n], np.float32),
                self.lr_at(state.steps),
            )
        return out, OuterState(state.steps + 1, momentum, state.buffer, state.residual)

    def _nesterov(self, u: F32 | None, p: F32, d: F32, lr: np.float32) -> tuple[F32, F32]:
        """``u' = u * mu + d`` (``d`` without a momentum yet), ``g = d + mu * u'`` (``u'`` without
        Nesterov) and ``p - lr * g``: the same float32 operations, a cache-sized chunk at a time, so
        the new parameters and momentum are the only arrays the size of the tensor it makes."""
        mu = np.float32(self.momentum)
        new_p, new_u = np.empty(p.shape, np.float32), np.empty(p.shape, np.float32)
        flat_p, flat_d, out_p, out_u = p.reshape(-1), d.reshape(-1), new_p.reshape(-1), new_u.reshape(-1)
        flat_u = None if u is None else u.reshape(-1)
        loop = compiled.loop(NESTEROV_LOOP, p.size) if self.nesterov else None
        if loop is not None and flat_u is not None and all(a.flags.c_contiguous for a in (p, d, flat_u)):
            ro = compiled.read_only
            loop(out_p, out_u, ro(flat_u), ro(flat_p), ro(flat_d), mu, lr)
            return new_p, _frozen(new_u)
        scratch = np.empty(min(_STEP_CHUNK, flat_p.size), np.float32)
        for start in range(0, flat_p.size, _STEP_CHUNK):
            span = slice(start, start + _STEP_CHUNK)
            uc, dc = out_u[span], flat_d[span]
            g = scratch[: uc.size]
            if flat_u is None:
                uc[...] = dc
            else:
                np.add(np.multiply(flat_u[span], mu, out=uc), dc, out=uc)
            if self.nesterov:
                np.add(dc, np.multiply(uc, mu, out=g), out=g)
            else:
                g[...] = uc
            np.subtract(flat_p[span], np.multiply(g, lr, out=g), out=out_p[span])
        return new_p, _frozen(new_u)

    def _delayed(
        self,
        state: OuterState,
        params: Mapping[str, npt.NDArray[np.floating]],
        delta: Mapping[str, npt.NDArray[np.floating]],
        count: int,
    ) -> tuple[dict[str, F32], OuterState]:
        n = self.delayed_every
        mu, inv_n = np.float32(self.momentum), np.float32(1.0 / n)
        # each contribution of the merge is one step of Algorithm 3, with that step's learning rate
        lrs = [self.lr_at(state.steps + i) for i in range(count)]
        uniform = all(x == lrs[0] for x in lrs)  # outside the warm-up: one rate, one product
        segments = delayed_segments(state.steps, count, n)
        ends = np.cumsum([steps for steps, _ in segments]) - 1  # each segment's last step in the merge
        momentum, buffer = dict(state.momentum), dict(state.buffer)
        out: dict[str, F32] = {}
        for name in params:
            p = np.asarray(params[name], np.float32)
            g = np.asarray(delta[name], np.float32)
            buf: F32 = state.buffer.get(name, np.zeros_like(p))
            u: F32 | None = state.momentum.get(name)
            applied: F32 | None = None  # the momenta applied by this merge's boundaries, each times its rate
            for (steps, boundary), end in zip(segments, ends, strict=True):
                buf = buf + g * np.float32(steps)
                if boundary:
                    u = (np.zeros_like(p) if u is None else u) * mu + buf * inv_n
                    term = u if uniform else lrs[end] * u
                    applied = term if applied is None else applied + term
                    buf = np.zeros_like(p)
            if uniform:
                d: F32 = (g * np.float32(count)) * inv_n
                step = lrs[0] * (d if applied is None else mu * applied + d)
            else:
                d = g * (np.float32(sum(lrs)) * inv_n)
                step = d if applied is None else mu * applied + d
            out[name] = (p - step).astype(np.float32, copy=False)
            if applied is not None:
                assert u is not None  # a boundary sets it
                momentum[name] = _frozen(u)
            buffer[name] = _frozen(buf)
        return out, OuterState(state.steps + count, momentum, buffer, state.residual)


def delayed_segments(steps: int, count: int, every: int) -> list[tuple[int, bool]]:
    """A merge of ``count`` contributions after ``steps`` earlier ones, cut where Delayed Nesterov's
    step counter reaches a multiple of ``every``: ``[(contributions, ends_at_a_boundary), ...]``.

    Async Local-SGD's Algorithm 3 applies one outer gradient per step; a merge of k contributions is
    k of those steps with the same merged gradient, so the momentum update at a boundary takes the
    buffer up to that boundary and the rest of the group starts the next buffer."""
    if count < 1 or every < 1 or steps < 0:
        raise ValueError(f"bad Delayed Nesterov counts: steps={steps}, count={count}, every={every}")
    out: list[tuple[int, bool]] = []
    t, left = steps, count
    while left:
        to_boundary = every - t % every
        take = min(to_boundary, left)
        out.append((take, take == to_boundary))
        t, left = t + take, left - take
    return out


def _nesterov_loop(njit: Callable[..., Any]) -> Any:
    """:meth:`OuterOptimizer._nesterov`'s float32 operations, in the same order, in one pass."""

    @njit(boundscheck=False)
    def step(new_p: Any, new_u: Any, u: Any, p: Any, d: Any, mu: Any, lr: Any) -> None:
        for i in range(p.size):
            j = np.uint64(i)
            momentum = u[j] * mu + d[j]
            new_u[j] = momentum
            new_p[j] = p[j] - (d[j] + momentum * mu) * lr

    return step


def _nesterov_sample() -> tuple[Any, ...]:
    out = (np.zeros(4, np.float32), np.zeros(4, np.float32))
    return (
        *out,
        *(compiled.read_only(np.zeros(4, np.float32)) for _ in range(3)),
        np.float32(0.9),
        np.float32(0.7),
    )


NESTEROV_LOOP = compiled.Loop(key="nesterov", build=_nesterov_loop, sample=_nesterov_sample)
