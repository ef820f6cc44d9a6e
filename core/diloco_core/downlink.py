"""Compressed global versions: what goes down to the learners is the quantized difference to the
previous version, and the version *is* the previous one plus that decoded difference.

When fragment ``p`` merges from version ``v`` to ``v + 1`` the synchronizer does not publish the
merged parameters ``M``; it encodes ``u = M - G_v + r`` (``r``: the residual of its previous update,
error feedback as in ``diloco_core.feedback``) with a low-bit quantizer and defines the new version
as ``G_{v+1} = G_v + decode(u)`` — float32 addition, the same on every machine — keeping
``r <- u - decode(u)``. A learner holding ``G_v`` applies the payload and obtains ``G_{v+1}`` bit for
bit, so learners and synchronizer never drift apart however many updates they chain. A learner
that does not hold ``G_v`` (it joined, resumed or missed an update) takes the full version instead,
on demand (:func:`apply` says when); resume and rejoin stay exact because every version is still a
definite array the synchronizer stores. The outer optimizer's step is not changed: the residual
carries the part of it not yet published into the next version.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from diloco_core import codec, compiled, feedback, update_kernel
from diloco_core.fragments import Fragment
from diloco_core.tensor_match import check_same_tensors

F32 = npt.NDArray[np.float32]
Arrays = Mapping[str, npt.NDArray[np.floating]]


@dataclass(frozen=True)
class Published:
    """Version ``version`` of a fragment as it goes down: the update's bytes, the version's values
    (previous + decoded update) and the synchronizer's new residual."""

    version: int
    blob: bytes
    params: dict[str, F32]
    residual: dict[str, F32]


def publish(
    previous: Arrays,
    merged: Arrays,
    residual: Arrays | None,
    *,
    fragment: int,
    version: int,
    quantizer: str,
    block_size: int = codec.q.DEFAULT_BLOCK_SIZE,
    owned: bool = False,
) -> Published:
    """Version ``version + 1`` from version ``version`` (``previous``) and the merge's result.

    One array per tensor holds ``merged - previous``, then that plus the residual, then the new
    residual; the decoded update becomes the new version in its own array: the same float32
    operations as :func:`add` and ``feedback.encode``, with two arrays per tensor instead of five.
    ``owned``: ``merged``'s float32 arrays are the caller's to give up, and the first of the two is
    theirs (the result of an outer step, which the new version replaces), so only one is made."""
    check_same_tensors(merged, previous, ("merged", "previous"))
    if quantizer == "int2":
        compiled_update = _int2_compiled(previous, merged, residual, fragment, version, block_size, owned)
        if compiled_update is not None:
            return compiled_update
    diff = {n: _difference(merged[n], previous[n], owned) for n in previous}
    enc = feedback.encode(
        diff,
        residual,
        fragment=fragment,
        base_version=version,
        kind="update",
        quantizer=quantizer,
        block_size=block_size,
        owned=True,
    )
    return Published(version + 1, enc.blob, add(previous, enc.decoded, in_place=True), enc.residual)


def _int2_compiled(
    previous: Arrays,
    merged: Arrays,
    residual: Arrays | None,
    fragment: int,
    version: int,
    block_size: int,
    owned: bool,
) -> Published | None:
    """:func:`publish` in int2 by the compiled loop (``update_kernel``), the same bytes and values;
    None while the loop is not ready (it is asked for by an update of ``WORTH_COMPILING`` values)."""
    values = sum(int(np.size(previous[n])) for n in previous)
    loop = compiled.loop(update_kernel.INT2_UPDATE, values)
    if loop is None:
        return None
    if residual is not None:
        check_same_tensors(residual, previous, ("residual", "delta"))
    codec.q.check_block_size(block_size)
    nan = np.uint32(codec.q.CANONICAL_NAN_BITS).view(np.float32)
    parts: dict[str, codec.QuantizedTensor] = {}
    params: dict[str, F32] = {}
    rest: dict[str, F32] = {}
    for name in sorted(previous):
        # np.require, not ascontiguousarray: a 0-d tensor keeps its shape ()
        prev = np.require(previous[name], np.float32, "C")
        given = merged[name]
        new_m = np.require(given, np.float32, "C")
        r = np.require(residual[name], np.float32, "C") if residual is not None else prev
        out_params = np.empty(prev.shape, np.float32)
        # the merged values are read a block ahead of the residual written in their place
        out_rest = new_m if owned and new_m is given else np.empty(prev.shape, np.float32)
        codes = np.zeros(-(-prev.size // 4), np.uint8)
        scales = np.empty(-(-prev.size // block_size), np.float32)
        flat = [compiled.read_only(a.reshape(-1)) for a in (prev, new_m, r)]
        loop(
            out_params.reshape(-1),
            out_rest.reshape(-1),
            codes,
            scales,
            *flat,
            residual is not None,
            block_size,
            nan,
        )
        parts[name] = codec.QuantizedTensor(
            prev.shape, codes.tobytes(), scales.astype("<f4").tobytes(), "float32"
        )
        params[name], rest[name] = out_params, out_rest
    blob = codec.encode_quantized(
        parts, fragment=fragment, base_version=version, kind="update", quantizer="int2", block_size=block_size
    )
    return Published(version + 1, blob, params, rest)


def _difference(merged: npt.NDArray[np.floating], previous: npt.NDArray[np.floating], owned: bool) -> F32:
    a, b = np.asarray(merged, np.float32), np.asarray(previous, np.float32)
    return np.subtract(a, b, out=a) if owned and a is merged else a - b


def add(previous: Arrays, update: Arrays, *, in_place: bool = False) -> dict[str, F32]:
    """``previous + update`` per tensor in float32: how both sides make the new version. ``in_place``:
    ``update``'s float32 arrays are the caller's to give up, and the sum is written into them."""
    if not in_place:
        return {n: np.asarray(previous[n], np.float32) + np.asarray(update[n], np.float32) for n in previous}
    return {n: np.add(np.asarray(previous[n], np.float32), update[n], out=update[n]) for n in previous}


def digest(arrays: Arrays) -> str:
    """A fragment's values as one hex digest (BLAKE2b, 128 bits) over its tensors' names, shapes and
    float32 bytes: two copies with the same digest are the same version bit for bit."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name], dtype=np.float32)
        h.update(f"{name}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def apply(
    known_version: int, known: Arrays, blob: bytes, fragment: Fragment
) -> tuple[int, dict[str, F32]] | None:
    """The version an update payload makes from the learner's copy of version ``known_version``, or
    None when the update applies to another version (the learner then takes the full version)."""
    return apply_decoded(known_version, known, codec.decode(blob, fragment=fragment))


def apply_decoded(
    known_version: int, known: Arrays, payload: codec.Payload
) -> tuple[int, dict[str, F32]] | None:
    """:func:`apply` on a payload already decoded (and checked against its fragment)."""
    if payload.kind != "update":
        raise codec.UnsupportedFormat(f"expected an update payload, got {payload.kind!r}")
    if payload.base_version != known_version:
        return None
    return known_version + 1, add(known, payload.tensors)
