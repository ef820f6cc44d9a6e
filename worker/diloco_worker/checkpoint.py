"""Learner checkpoints: tensors in safetensors, everything else in JSON (no pickle anywhere).

Layout under the checkpoint location (a local folder, ``file:///path`` or ``s3://bucket/prefix``):
``ckpt-<step>/tensors.safetensors`` (parameters, AdamW state, anchors, error-feedback residuals, the torch CPU generator and,
with CUDA, every visible GPU's generator) and ``ckpt-<step>/meta.json`` (step, tokens, data cursor,
fragment counters, optimizer hyper-parameters, config, Python's ``random`` state), and the outer
gradients the synchronizer had not durably taken (module ``unacknowledged``: their payloads in the
tensors, what they are in ``outgoing``).
``meta.json`` is written last, so a checkpoint without it is incomplete and ignored.

The worker itself draws no random numbers from Python's global ``random`` (its data order is a pure
function of seed and batch number), but a user entry point may, so its state is kept too.
"""

from __future__ import annotations

import json
import logging
import random
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diloco_core.storage import FilesystemStore, ObjectStore, StorageError, open_store
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from .fragment_state import Outgoing
from .unacknowledged import Unacknowledged, decode_parts, encode_parts

log = logging.getLogger("diloco_worker.checkpoint")
FORMAT = 1
_DIR_RE = re.compile(r"^ckpt-(\d{10})/meta\.json$")


def open_checkpoint_store(location: str) -> ObjectStore:
    """A local folder path, ``file:///path`` or ``s3://bucket/prefix``."""
    return open_store(location) if "://" in location else FilesystemStore(location)


@dataclass
class Checkpoint:
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    def anchors(self) -> dict[int, dict[str, np.ndarray]]:
        return self._per_fragment("anchor/")

    def residuals(self) -> dict[int, dict[str, np.ndarray]]:
        """The error-feedback residuals (none in a checkpoint written without error feedback)."""
        return self._per_fragment("residual/")

    def held(self) -> dict[int, tuple[int, dict[str, np.ndarray]]]:
        """Global versions the learner held exactly (with compressed downloads): per fragment, the
        version and its values."""
        versions = {int(p): int(v) for p, v in self.meta.get("held_versions", {}).items()}
        return {
            p: (versions[p], values) for p, values in self._per_fragment("held/").items() if p in versions
        }

    def outgoing(self) -> list[Outgoing]:
        """The outer gradients to send again first, per fragment in sequence order (none in a
        checkpoint written without them)."""
        return decode_parts(self.meta.get("outgoing", []), self.tensors)

    def _per_fragment(self, prefix: str) -> dict[int, dict[str, np.ndarray]]:
        out: dict[int, dict[str, np.ndarray]] = {}
        for key, t in self.tensors.items():
            if key.startswith(prefix):
                _, p, name = key.split("/", 2)
                out.setdefault(int(p), {})[name] = t.numpy()
        return out


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    sd = opt.state_dict()
    tensors = {
        f"optim/{idx}/{k}": _copy_to_host(v)
        for idx, st in sd["state"].items()
        for k, v in st.items()
        if isinstance(v, torch.Tensor)
    }
    return tensors, sd["param_groups"]


def _copy_to_host(t: torch.Tensor) -> torch.Tensor:
    """An independent contiguous CPU copy (one copy, from a GPU or within the host)."""
    return t.detach().to("cpu", copy=True).contiguous()


def build_tensors(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    anchors: Mapping[int, Mapping[str, np.ndarray]],
    residuals: Mapping[int, Mapping[str, np.ndarray]] | None = None,
    held: Mapping[int, Mapping[str, np.ndarray]] | None = None,
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Everything tensor-shaped, as independent contiguous CPU tensors keyed by role (copies: the
    live state may change while they are written)."""
    tensors = {f"param/{n}": _copy_to_host(p) for n, p in model.named_parameters()}
    tensors.update({f"buffer/{n}": _copy_to_host(b) for n, b in model.named_buffers()})
    opt_tensors, groups = _optimizer_tensors(opt)
    tensors.update(opt_tensors)
    for role, per_fragment in (("anchor", anchors), ("residual", residuals or {}), ("held", held or {})):
        for p, frag in per_fragment.items():
            tensors.update(
                {
                    f"{role}/{p}/{n}": torch.from_numpy(np.array(a, order="C", copy=True))
                    for n, a in frag.items()
                }
            )
    tensors.update(build_rng_tensors())
    return tensors, groups


def build_rng_tensors() -> dict[str, torch.Tensor]:
    """The torch generators: the CPU one and, when CUDA is available, one per visible GPU."""
    tensors = {"rng/torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = state.cpu()
    return tensors


def python_rng_meta() -> dict[str, Any]:
    """Python's global ``random`` state as JSON: ``[version, 625 ints, gauss_next]``."""
    version, internal, gauss = random.getstate()
    return {"python": [version, list(internal), gauss]}


def restore_rng(ckpt: Checkpoint) -> None:
    """Set the torch CPU generator, the CUDA generators (only when this process sees as many GPUs as
    the one that saved them) and Python's ``random`` (when the checkpoint has them)."""
    torch.set_rng_state(ckpt.tensors["rng/torch"])
    count = sum(1 for key in ckpt.tensors if key.startswith("rng/cuda/"))
    cuda = [ckpt.tensors[f"rng/cuda/{i}"] for i in range(count)]
    if cuda:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
            torch.cuda.set_rng_state_all(cuda)
        else:
            seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
            log.warning(
                "checkpoint step %d holds the generators of %d GPUs, this process sees %d: "
                "CUDA generators not restored",
                ckpt.step,
                len(cuda),
                seen,
            )
    saved = ckpt.meta.get("rng", {}).get("python")
    if saved is not None:
        version, internal, gauss = saved
        random.setstate((version, tuple(internal), gauss))


@dataclass(frozen=True)
class Snapshot:
    """A checkpoint's content, copied out of the live state: writing it can wait (another thread)."""

    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    outgoing: Unacknowledged | None = None  # encoded by the writer (compression off the training thread)


def snapshot_checkpoint(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    anchors: Mapping[int, Mapping[str, np.ndarray]],
    meta: Mapping[str, Any],
    residuals: Mapping[int, Mapping[str, np.ndarray]] | None = None,
    held: Mapping[int, tuple[int, Mapping[str, np.ndarray]]] | None = None,
    outgoing: Unacknowledged | None = None,
) -> Snapshot:
    """Copy what a checkpoint of ``meta['step']`` holds (the training thread's part of a save).
    ``held``: the global versions the learner holds exactly, per fragment (version, values);
    ``outgoing``: the outer gradients not durably taken yet (their payloads are built when written)."""
    held = held or {}
    tensors, groups = build_tensors(
        model, optimizer, anchors, residuals, {p: v for p, (_, v) in held.items()}
    )
    full_meta = {
        "format": FORMAT, **meta, "held_versions": {str(p): version for p, (version, _) in held.items()},
        "optimizer_groups": groups, "rng": python_rng_meta(),
    }  # fmt: skip
    return Snapshot(int(meta["step"]), tensors, full_meta, outgoing)


def write_checkpoint(store: ObjectStore, snap: Snapshot, keep: int = 2) -> str:
    """Write a snapshot (``meta.json`` last), then delete all but the newest ``keep`` checkpoints."""
    prefix = f"ckpt-{snap.step:010d}/"
    tensors, meta = snap.tensors, snap.meta
    if snap.outgoing is not None:
        payloads, records = encode_parts(snap.outgoing)
        tensors, meta = {**tensors, **payloads}, {**meta, "outgoing": records}
    store.put(prefix + "tensors.safetensors", st_save(tensors))
    store.put(prefix + "meta.json", json.dumps(meta, sort_keys=True).encode())
    for old in list_checkpoints(store)[:-keep]:
        for key in store.list(f"ckpt-{old:010d}/"):
            store.delete(key)
        if isinstance(store, FilesystemStore):  # no empty folder left behind
            store.remove_empty_folder(f"ckpt-{old:010d}/")
    return prefix


def save_checkpoint(
    store: ObjectStore,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    anchors: Mapping[int, Mapping[str, np.ndarray]],
    meta: Mapping[str, Any],
    keep: int = 2,
    residuals: Mapping[int, Mapping[str, np.ndarray]] | None = None,
    held: Mapping[int, tuple[int, Mapping[str, np.ndarray]]] | None = None,
    outgoing: Unacknowledged | None = None,
) -> str:
    """Write a checkpoint for ``meta['step']`` now (:func:`snapshot_checkpoint`, then
    :func:`write_checkpoint`)."""
    snap = snapshot_checkpoint(
        model=model,
        optimizer=optimizer,
        anchors=anchors,
        meta=meta,
        residuals=residuals,
        held=held,
        outgoing=outgoing,
    )
    return write_checkpoint(store, snap, keep)


class CheckpointWriter:
    """Writes snapshots in a background thread, one at a time, so that the training thread only
    copies the state: serialising and storing it (most of a save's time on a large model) overlap
    with training. A new snapshot waits for the previous write; a failed write is raised at the next
    :meth:`submit` or at :meth:`close`, which waits for the last one."""

    def __init__(self, store: ObjectStore, *, keep: int = 2, on_written: Callable[[int], None] | None = None):
        self.store, self.keep, self.on_written = store, keep, on_written
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _write(self, snap: Snapshot) -> None:
        try:
            write_checkpoint(self.store, snap, self.keep)
        except BaseException as exc:  # handed to the training thread
            self._error = exc
            return
        if self.on_written is not None:
            self.on_written(snap.step)

    def _wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    @property
    def busy(self) -> bool:
        """A write is still in progress."""
        return self._thread is not None and self._thread.is_alive()

    def takes(self, final: bool) -> bool:
        """Whether a checkpoint due now is taken: always the final one (it waits for the previous
        write), a periodic one only when no write is in progress (training does not wait for
        storage: checkpoints come as often as asked or as often as storage keeps up)."""
        return final or not self.busy

    def submit(self, snap: Snapshot) -> None:
        self._wait()
        self._thread = threading.Thread(
            target=self._write, args=(snap,), name="checkpoint-writer", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._wait()


def list_checkpoints(store: ObjectStore) -> list[int]:
    """Steps of the complete checkpoints, oldest first."""
    steps = [int(m.group(1)) for k in store.list("ckpt-") if (m := _DIR_RE.match(k))]
    return sorted(steps)


def load_at(store: ObjectStore, step: int) -> Checkpoint | None:
    """The complete checkpoint of ``step``, or None when it is missing or cannot be read."""
    prefix = f"ckpt-{step:010d}/"
    try:
        meta = json.loads(store.get(prefix + "meta.json"))
        tensors = st_load(store.get(prefix + "tensors.safetensors"))
    except (StorageError, ValueError, OSError, SafetensorError) as exc:
        log.warning("skipping unreadable checkpoint %s: %s", prefix, exc)
        return None
    if meta.get("format") != FORMAT:
        log.warning("skipping checkpoint %s of unknown format %r", prefix, meta.get("format"))
        return None
    return Checkpoint(meta, tensors)


def newest_readable(stores: Sequence[ObjectStore]) -> tuple[Checkpoint | None, ObjectStore | None]:
    """The newest complete checkpoint over these stores that can be read, and its store (an
    unreadable one is passed over for the next older); (None, None) when there is none."""
    found = sorted(
        ((step, i) for i, store in enumerate(stores) for step in list_checkpoints(store)), reverse=True
    )
    for step, i in found:
        ckpt = load_at(stores[i], step)
        if ckpt is not None:
            return ckpt, stores[i]
    return None, None


def load_latest(store: ObjectStore) -> Checkpoint | None:
    """The newest complete checkpoint that can be read, or None."""
    return newest_readable([store])[0]


def common_step(per_rank: Sequence[Sequence[int]]) -> int:
    """The newest checkpoint step every rank of a unit holds, 0 when there is none.

    The ranks of a data-parallel unit take every step together, so they must resume from the same
    one; a failure between two ranks' writes of a checkpoint leaves them one checkpoint apart.
    """
    shared = set(per_rank[0]).intersection(*per_rank[1:]) if per_rank else set()
    return max(shared, default=0)


@torch.no_grad()
def restore(ckpt: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load parameters, buffers, AdamW state and the random generators into live objects (same model
    shape)."""
    for kind, named in (("param", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            key = f"{kind}/{name}"
            if key not in ckpt.tensors:
                raise ValueError(f"checkpoint step {ckpt.step} has no tensor {key!r}; was the model changed?")
            src = ckpt.tensors[key]
            if src.shape != t.shape:
                raise ValueError(
                    f"checkpoint tensor {key!r} has shape {tuple(src.shape)}, model {tuple(t.shape)}"
                )
            t.copy_(src)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, v in ckpt.tensors.items():
        if key.startswith("optim/"):
            _, idx, k = key.split("/", 2)
            state.setdefault(int(idx), {})[k] = v
    groups = ckpt.meta["optimizer_groups"]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    restore_rng(ckpt)
