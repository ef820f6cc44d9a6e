"""The torch anchor store: each fragment's anchor as a flat float32 buffer
(``torch_quantize.FlatLayout``) on the learner's device, or in pinned host memory when it does not
fit there; byte-identical payloads to the numpy reference (:class:`.anchors.HostAnchors`).

At a due step the training thread only queues work on a side CUDA stream: copy the parameters,
subtract, quantize, copy the result into pinned host buffers, record an event; the sender thread
waits for that event and then only compresses and sends. A global version is decoded and copied to
the device by the poller thread, on a staging stream, into a staging buffer
(:meth:`DeviceAnchors.stage`); at the step boundary the training thread makes its stream wait for
that copy and copies the staging buffer into the parameters, device to device; the staging buffer
becomes the anchor.

With error feedback (docs/algorithm.md §3.9) it also keeps each fragment's residual, flat and where
its anchor is: the side stream adds it to ``anchor - params`` before quantizing and leaves the new
residual (what the payload does not carry) in its place, so the training thread still only queues
work. The formats without a torch quantizer get ``anchor - params`` as host arrays, and their
caller keeps error feedback.

On a CPU it runs the same code without streams or pinned memory (everything is synchronous), which
is how its payloads are checked against the reference without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from diloco_core import codec
from diloco_core import quantize as q
from diloco_core.fragments import FragmentPlan
from diloco_core.learner import outer_gradient
from torch import Tensor

from .anchor_store import Arrays
from .torch_quantize import FORMATS, FlatLayout, QuantizedFlat, dequantize, quantize_flat

log = logging.getLogger("diloco_worker.anchors")

Placement = Literal["auto", "device", "host"]


@dataclass(frozen=True)
class DeviceSnapshot:
    """A quantized outer gradient on its way to pinned host buffers; ``done`` marks its arrival."""

    layout: FlatLayout
    quantizer: str
    values: Tensor  # uint8, host (pinned on CUDA)
    scales: Tensor
    done: torch.cuda.Event | None  # None: already there (CPU)

    def encode(self, *, fragment: int, base_version: int, quantizer: str) -> bytes:
        """Wait for the copy (the caller's thread only), then build the payload (zstd)."""
        if quantizer != self.quantizer:
            raise ValueError(f"outer gradient quantized as {self.quantizer}, asked for {quantizer}")
        if self.done is not None:
            self.done.synchronize()
        parts = self.layout.parts(quantizer, self.values.numpy(), self.scales.numpy())
        return codec.encode_quantized(
            parts,
            fragment=fragment,
            base_version=base_version,
            kind="outer_grad",
            quantizer=quantizer,
            block_size=self.layout.block_size,
        )


class StagedGlobal(Mapping[str, np.ndarray]):
    """A decoded global version of one fragment, also laid out flat in host memory (pinned on
    CUDA) and on its way to a device buffer; ``ready`` marks the end of that copy. It reads as the
    decoded arrays, so code that only needs those (a unit broadcasting to its other ranks) does not
    need to know about it."""

    def __init__(
        self,
        fragment: int,
        layout: FlatLayout,
        arrays: Arrays,
        host: Tensor,
        device: Tensor,
        ready: torch.cuda.Event | None,
    ) -> None:
        self.fragment, self.layout, self._arrays = fragment, layout, arrays
        self.host, self.device, self.ready = host, device, ready

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)


def choose_placement(
    *, anchor_bytes: int, param_bytes: int, work_bytes: int, free_bytes: int, total_bytes: int
) -> Literal["device", "host"]:
    """Anchors go on the device when they fit next to what training still needs there: the AdamW
    moments (twice the parameters; allocated at the first step), the side stream's work buffers,
    and a fifth of the device's memory kept for activations. Otherwise pinned host memory."""
    needed = anchor_bytes + 2 * param_bytes + work_bytes + total_bytes // 5
    return "device" if needed <= free_bytes else "host"


def _copy_all(targets: Sequence[Tensor], sources: Sequence[Tensor]) -> None:
    if not targets:
        return
    if all(t.dtype == s.dtype and t.device == s.device for t, s in zip(targets, sources, strict=True)):
        torch._foreach_copy_(list(targets), list(sources))  # one launch for the whole fragment on CUDA
    else:
        for t, s in zip(targets, sources, strict=True):
            t.copy_(s)


class DeviceAnchors:
    """Anchors as flat float32 buffers on ``device`` (or pinned host memory); torch arithmetic."""

    def __init__(
        self,
        plan: FragmentPlan,
        params: Mapping[str, Tensor],
        device: torch.device,
        placement: Placement = "auto",
        block_size: int = q.DEFAULT_BLOCK_SIZE,
    ) -> None:
        self.plan, self.device = plan, device
        self.cuda = device.type == "cuda"
        self.layouts = {f.index: FlatLayout.of(f.tensors, block_size) for f in plan.fragments}
        self.params = {p: [params[n] for n in layout.names] for p, layout in self.layouts.items()}
        longest = max((layout.total for layout in self.layouts.values()), default=0)
        self.placement = self._place(placement, longest) if self.cuda else "device"
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.staging = torch.cuda.Stream(device) if self.cuda else None
        self.work = torch.zeros(longest, dtype=torch.float32, device=device)
        self.anchors: dict[int, Tensor] = {p: self._flat_of_params(p) for p in self.layouts}
        # error feedback: per fragment, flat like its anchor and where it is, padding always zero;
        # written on the side stream
        self.residuals: dict[int, Tensor] = {}

    def _place(self, wanted: Placement, longest: int) -> Literal["device", "host"]:
        anchor_bytes = 4 * sum(layout.total for layout in self.layouts.values())
        free, total = torch.cuda.mem_get_info(self.device)
        param_bytes = sum(t.numel() * t.element_size() for ts in self.params.values() for t in ts)
        chosen = (
            wanted
            if wanted != "auto"
            else choose_placement(
                anchor_bytes=anchor_bytes,
                param_bytes=param_bytes,
                work_bytes=16 * longest,
                free_bytes=free,
                total_bytes=total,
            )
        )
        log.info(
            "anchors of %.1f MiB in %s memory (%s; %.1f of %.1f GiB free on %s)",
            anchor_bytes / 2**20,
            "device" if chosen == "device" else "pinned host",
            "chosen" if wanted == "auto" else "as configured",
            free / 2**30,
            total / 2**30,
            self.device,
        )
        return chosen

    @property
    def anchor_device(self) -> torch.device:
        return self.device if self.placement == "device" else torch.device("cpu")

    def _empty_host(self, n: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(n, dtype=dtype, pin_memory=self.cuda)

    def _zeros_at_anchors(self, n: int) -> Tensor:
        """A zeroed float32 buffer where the anchors are (the device, or pinned host memory)."""
        if self.placement == "host":
            return self._empty_host(n, torch.float32).zero_()
        return torch.zeros(n, dtype=torch.float32, device=self.device)

    @torch.no_grad()
    def _flat_of_params(self, p: int) -> Tensor:
        layout = self.layouts[p]
        flat = torch.zeros(layout.total, dtype=torch.float32, device=self.device)
        _copy_all(layout.views(flat), self.params[p])
        if self.placement == "host":
            host = self._empty_host(layout.total, torch.float32)
            host.copy_(flat)
            return host
        return flat

    @contextlib.contextmanager
    def _on_side_stream(self) -> Iterator[tuple[torch.cuda.Stream, torch.cuda.Stream] | None]:
        """(training stream, side stream), the side stream running after everything the training
        stream has queued so far; None on a CPU."""
        if self.side is None:
            yield None
            return
        main = torch.cuda.current_stream(self.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            yield main, self.side

    # ---- the interface ----
    def arrays(self, p: int) -> dict[str, np.ndarray]:
        layout = self.layouts[p]
        flat = self.anchors[p].cpu()
        return {s.name: v.numpy().copy() for s, v in zip(layout.specs, layout.views(flat), strict=True)}

    def feeds_back(self, quantizer: str) -> bool:
        return quantizer in FORMATS

    def _side_done(self) -> None:
        """Wait until the side stream's queued work (residual updates) is done."""
        if self.side is not None:
            self.side.synchronize()

    def residual(self, p: int) -> dict[str, np.ndarray] | None:
        if p not in self.residuals:
            return None
        self._side_done()
        layout, flat = self.layouts[p], self.residuals[p].cpu()
        return {s.name: v.numpy().copy() for s, v in zip(layout.specs, layout.views(flat), strict=True)}

    def set_residual(self, p: int, arrays: Arrays) -> None:
        self._side_done()
        layout = self.layouts[p]
        target = self._zeros_at_anchors(layout.total)
        for view, name in zip(layout.views(target), layout.names, strict=True):
            view.copy_(torch.from_numpy(np.asarray(arrays[name], dtype=np.float32)))
        self.residuals[p] = target

    @torch.no_grad()
    def _feed_back(self, p: int, work: Tensor, out: QuantizedFlat, quantizer: str) -> None:
        """The new residual of fragment ``p``: ``work`` (the compensated outer gradient) minus what
        its quantization ``out`` decodes to, in the tensors' regions (the padding stays zero)."""
        layout = self.layouts[p]
        left = work.sub_(dequantize(out.values, out.scales, quantizer, layout.total, layout.block_size))
        target = self.residuals.get(p)
        if target is None:
            target = self.residuals[p] = self._zeros_at_anchors(layout.total)
        if target.device == left.device:
            _copy_all(layout.views(target), layout.views(left))
        else:  # pinned host memory: the whole buffer back (the padding of ``left`` is zeroed first)
            padded = torch.zeros_like(left)
            _copy_all(layout.views(padded), layout.views(left))
            target.copy_(padded, non_blocking=True)

    @torch.no_grad()
    def outer_gradient(self, p: int, quantizer: str, error_feedback: bool = False) -> DeviceSnapshot | Arrays:
        """Queue ``anchor - params`` (plus the residual, with ``error_feedback``) and its
        quantization; the training stream only waits (on the device) until the parameters have been
        read, and the training thread not at all. A format without a torch implementation gets
        ``anchor - params`` as host arrays (the reference; its caller keeps error feedback)."""
        if quantizer not in FORMATS:
            if error_feedback:
                raise ValueError(f"no torch implementation of {quantizer!r}: its caller keeps error feedback")
            params = {
                n: t.detach().float().cpu().numpy()
                for n, t in zip(self.layouts[p].names, self.params[p], strict=True)
            }
            return outer_gradient(self.arrays(p), params)
        layout = self.layouts[p]
        with self._on_side_stream() as streams:
            work = self.work[: layout.total]
            work.zero_()
            _copy_all(layout.views(work), self.params[p])
            anchor, done = self.anchors[p], None
            if streams is not None:
                main, side = streams
                read = torch.cuda.Event()
                read.record(side)
                main.wait_event(read)  # the next optimizer step changes the parameters once they are read
                if anchor.device.type == "cuda":
                    anchor.record_stream(side)
                else:
                    anchor = anchor.to(self.device, non_blocking=True)
            torch.sub(anchor, work, out=work)
            if error_feedback and p in self.residuals:
                work.add_(self.residuals[p].to(self.device, non_blocking=True))
            out = quantize_flat(work, quantizer, layout)
            values = self._empty_host(out.values.numel(), torch.uint8)
            scales = self._empty_host(out.scales.numel(), torch.uint8)
            values.copy_(out.values, non_blocking=self.cuda)
            scales.copy_(out.scales, non_blocking=self.cuda)
            if error_feedback:
                self._feed_back(p, work, out, quantizer)
            if streams is not None:
                done = torch.cuda.Event()
                done.record(streams[1])
        return DeviceSnapshot(layout, quantizer, values, scales, done)

    def advance_anchor(self, p: int) -> None:
        # a new buffer, not an overwrite: a queued outer gradient may still be reading the old one
        self.anchors[p] = self._flat_of_params(p)

    def stage(self, p: int, arrays: dict[str, np.ndarray]) -> StagedGlobal:
        """Lay a decoded global version out flat in host memory and start its copy to the device."""
        layout = self.layouts[p]
        host = self._empty_host(layout.total, torch.float32)
        host.zero_()
        for view, name in zip(layout.views(host), layout.names, strict=True):
            view.copy_(torch.from_numpy(np.asarray(arrays[name], dtype=np.float32)))
        if self.staging is None:
            return StagedGlobal(p, layout, arrays, host, host, None)
        with torch.cuda.stream(self.staging):
            dev = host.to(self.device, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.staging)
        return StagedGlobal(p, layout, arrays, host, dev, ready)

    @torch.no_grad()
    def apply(self, p: int, values: Arrays, alpha: float) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        layout = self.layouts[p]
        staged = values if isinstance(values, StagedGlobal) and values.layout == layout else None
        if staged is None:
            staged = self.stage(p, dict(values))
        if staged.ready is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(staged.ready)
            staged.device.record_stream(main)
        params, new = self.params[p], layout.views(staged.device)
        if alpha == 0.0:
            _copy_all(params, new)
        else:  # three separately rounded float32 operations, as the reference computes them
            mixed = torch._foreach_add(
                torch._foreach_mul([t.float() for t in params], alpha), torch._foreach_mul(new, 1.0 - alpha)
            )
            _copy_all(params, mixed)
        self.anchors[p] = staged.device if self.placement == "device" else staged.host

    def load(self, p: int, arrays: Arrays) -> None:
        staged = self.stage(p, dict(arrays))
        if staged.ready is not None:
            staged.ready.synchronize()
        self.anchors[p] = staged.device if self.placement == "device" else staged.host
