"""A learner unit: the processes (pods) of one data-parallel group.

From the StatefulSet environment: ``WORLD_SIZE`` (default 1), ``RANK`` or else the pod ordinal at the
end of ``HOSTNAME`` (``job-unit-a-2`` → 2), ``MASTER_ADDR`` / ``MASTER_PORT`` (rank 0's address). gloo on
CPU, NCCL on CUDA. Only rank 0 talks to the synchronizer; at every step boundary it tells its peers
whether to stop and which global fragments to take, and broadcasts those fragments' tensors.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from diloco_core.fragments import FragmentPlan
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

Arrivals = dict[int, tuple[int, Mapping[str, np.ndarray]]]
_ORDINAL_RE = re.compile(r"-(\d+)$")


class UnitConfigError(ValueError):
    """The unit's environment is incomplete or inconsistent."""


def rank_from_env(env: Mapping[str, str]) -> tuple[int, int]:
    """(rank, world size) from RANK/WORLD_SIZE or the StatefulSet pod ordinal in HOSTNAME."""
    try:
        world = int(env.get("WORLD_SIZE", "1"))
    except ValueError:
        raise UnitConfigError(f"WORLD_SIZE must be an integer, got {env.get('WORLD_SIZE')!r}") from None
    if world < 1:
        raise UnitConfigError(f"WORLD_SIZE must be >= 1, got {world}")
    if world == 1:
        return 0, 1
    if "RANK" in env:
        try:
            rank = int(env["RANK"])
        except ValueError:
            raise UnitConfigError(f"RANK must be an integer, got {env['RANK']!r}") from None
    else:
        m = _ORDINAL_RE.search(env.get("HOSTNAME", ""))
        if not m:
            raise UnitConfigError(
                "WORLD_SIZE > 1 needs RANK or a StatefulSet HOSTNAME ending in '-<ordinal>'"
            )
        rank = int(m.group(1))
    if not 0 <= rank < world:
        raise UnitConfigError(f"rank {rank} is outside 0..{world - 1}")
    return rank, world


@dataclass
class Collective:
    """Bytes of the gradients this rank handed to the unit's all-reduce (DDP's buckets)."""

    reduced: int = 0

    def ring_bytes(self, world_size: int) -> int:
        """What a ring all-reduce of them sends from this rank, and receives: 2 (n-1)/n of each
        buffer (a reduce-scatter and an all-gather)."""
        return 2 * (world_size - 1) * self.reduced // world_size if world_size > 1 else 0


def _counted_allreduce(state: Collective, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    state.reduced += buffer.numel() * buffer.element_size()
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]  # None: the default group


# DDP checks the hook's annotations as objects; this module's are strings (postponed evaluation)
_counted_allreduce.__annotations__ = {
    "state": Collective, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor],
}  # fmt: skip


@dataclass
class Unit:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")  # noqa: RUF009 - immutable
    collective: Collective = field(default_factory=Collective)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def wrap(self, model: nn.Module) -> nn.Module:
        """DDP around the model inside a multi-process unit (it also copies rank 0's weights to all)."""
        if not self.distributed:
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=ids)
        ddp.register_comm_hook(self.collective, _counted_allreduce)  # DDP's all-reduce, counted
        return ddp

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module, skip: bool) -> Iterator[None]:
        """Skip the gradient all-reduce on all but the last micro-batch of an accumulated step."""
        if skip and isinstance(model, DistributedDataParallel):
            with model.no_sync():
                yield
        else:
            yield

    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def boundary(self, stop: bool, arrivals: Arrivals, plan: FragmentPlan | None) -> tuple[bool, Arrivals]:
        """Rank 0's decision (stop? which global fragments?) made identical on every rank."""
        if not self.distributed:
            return stop, arrivals
        n = len(plan.fragments) if plan else 0
        header = torch.full((1 + n,), -2, dtype=torch.int64, device=self._comm_device())
        if self.is_leader:
            header[0] = int(stop)
            for p, (version, _) in arrivals.items():
                header[1 + p] = version
        dist.broadcast(header, src=0)
        values = header.tolist()
        out: Arrivals = {}
        for p in range(n):
            if values[1 + p] == -2:
                continue
            assert plan is not None
            tensors: dict[str, np.ndarray] = {}
            for spec in plan.fragments[p].tensors:
                if self.is_leader:
                    t = torch.from_numpy(np.ascontiguousarray(arrivals[p][1][spec.name])).to(
                        self._comm_device()
                    )
                else:
                    t = torch.empty(spec.shape, dtype=torch.float32, device=self._comm_device())
                dist.broadcast(t, src=0)
                tensors[spec.name] = t.cpu().numpy()
            out[p] = (int(values[1 + p]), tensors)
        return bool(values[0]), out

    def share_flag(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank."""
        return bool(self.share_int(int(flag)))

    def share_flags(self, flags: Sequence[bool]) -> list[bool]:
        """Rank 0's ``flags`` on every rank: one byte each, so a flag per fragment fits however many
        fragments the job has. Every rank passes as many flags as rank 0 (the others' values are
        ignored)."""
        if not self.distributed or not flags:
            return [bool(f) for f in flags]
        t = torch.tensor([bool(f) for f in flags], dtype=torch.uint8, device=self._comm_device())
        dist.broadcast(t, src=0)
        return [bool(v) for v in t.tolist()]

    def share_set(self, members: Collection[int], size: int) -> set[int]:
        """Rank 0's ``members`` (indices in ``range(size)``, e.g. fragments) on every rank; every rank
        passes the same ``size`` (the others' members are ignored)."""
        if any(not 0 <= m < size for m in members):
            raise ValueError(f"share_set takes indices in 0..{size - 1}, got {sorted(members)}")
        chosen = set(members)
        flags = self.share_flags([m in chosen for m in range(size)])
        return {m for m, flag in enumerate(flags) if flag}

    def share_int(self, value: int) -> int:
        """Rank 0's ``value`` on every rank (a signed 64-bit integer)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self._comm_device())
        dist.broadcast(t, src=0)
        return int(t.item())

    def share_float(self, value: float) -> float:
        """Rank 0's ``value`` on every rank."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self._comm_device())
        dist.broadcast(t, src=0)
        return float(t.item())

    def share_bytes(self, data: bytes) -> bytes:
        """Rank 0's ``data`` on every rank (what the others pass is ignored)."""
        if not self.distributed:
            return data
        size = self.share_int(len(data))
        if size == 0:
            return b""
        if self.is_leader:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self._comm_device())
        else:
            buf = torch.empty(size, dtype=torch.uint8, device=self._comm_device())
        dist.broadcast(buf, src=0)
        return buf.cpu().numpy().tobytes()

    def all_min(self, value: int) -> int:
        """The smallest ``value`` over the unit's ranks, on every rank."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def gather_ints(self, values: Sequence[int], width: int) -> list[list[int]]:
        """Every rank's ``values`` (at most ``width`` non-negative ints), in rank order, on every rank."""
        if len(values) > width or any(v < 0 for v in values):
            raise ValueError(f"gather_ints takes at most {width} non-negative ints, got {list(values)}")
        if not self.distributed:
            return [list(values)]
        mine = torch.full((width,), -1, dtype=torch.int64, device=self._comm_device())
        mine[: len(values)] = torch.tensor(list(values), dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(parts, mine)
        return [[v for v in part.tolist() if v >= 0] for part in parts]

    def close(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


def join_unit(env: Mapping[str, str], device: torch.device, timeout_s: float = 300.0) -> Unit:
    """Join the unit's process group (nothing to do for a single-process unit)."""
    rank, world = rank_from_env(env)
    if world == 1:
        return Unit(0, 1, device)
    if not env.get("MASTER_ADDR"):
        raise UnitConfigError("WORLD_SIZE > 1 needs MASTER_ADDR (the address of rank 0 of the unit)")
    backend = "nccl" if device.type == "cuda" else "gloo"
    init = f"tcp://{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '29500')}"
    dist.init_process_group(
        backend, init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    return Unit(rank, world, device)
