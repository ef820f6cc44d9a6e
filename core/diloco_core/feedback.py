"""Error feedback: what quantization leaves out of one payload is carried into the next.

A learner with error feedback keeps, per fragment, the residual ``r`` of its last payload. Its next
outer gradient ``delta`` is sent as ``c = delta + r`` and the new residual is ``c - decode(encode(c))``,
so over many rounds every part of every outer gradient reaches the synchronizer, only later (EF-SGD,
1-bit Adam; what makes the 2-bit, 1-bit and top-k formats usable). The residual is learner state:
it is checkpointed with the learner and restored on resume. The same rule on the synchronizer's side
compresses what goes down (``diloco_core.downlink``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from diloco_core import codec
from diloco_core.tensor_match import check_same_tensors

F32 = npt.NDArray[np.float32]
Arrays = Mapping[str, npt.NDArray[np.floating]]


@dataclass(frozen=True)
class Encoded:
    """A payload with error feedback: its bytes, what the receiver decodes, and the new residual."""

    blob: bytes
    decoded: dict[str, F32]
    residual: dict[str, F32]
    fragment: int
    base_version: int
    quantizer: str

    def encode(self, *, fragment: int, base_version: int, quantizer: str) -> bytes:
        """The payload, already encoded (the residual depends on it); the arguments must be its own."""
        if (fragment, base_version, quantizer) != (self.fragment, self.base_version, self.quantizer):
            raise ValueError(
                f"payload of fragment {self.fragment} v{self.base_version} in {self.quantizer}, asked for "
                f"fragment {fragment} v{base_version} in {quantizer}"
            )
        return self.blob


def compensate(delta: Arrays, residual: Arrays | None, *, in_place: bool = False) -> dict[str, F32]:
    """``delta + residual`` per tensor (``delta`` alone without a residual). ``in_place``: ``delta``'s
    float32 arrays are the caller's to give up, and the sum is written into them instead of a copy."""
    if residual is not None:
        check_same_tensors(residual, delta, ("residual", "delta"))
    out = {}
    for name, d in delta.items():
        d32 = np.asarray(d, np.float32)
        if residual is None:
            out[name] = d32 if in_place else d32.copy()
            continue
        r = np.asarray(residual[name], np.float32)
        out[name] = np.add(d32, r, out=d32) if in_place else d32 + r
    return out


def encode(
    delta: Arrays,
    residual: Arrays | None,
    *,
    fragment: int,
    base_version: int,
    kind: codec.PayloadKind,
    quantizer: str,
    block_size: int = codec.q.DEFAULT_BLOCK_SIZE,
    owned: bool = False,
) -> Encoded:
    """Encode ``delta + residual``; the new residual is what the payload does not carry. A non-finite
    value leaves a non-finite residual, which the merge refuses the next time (``merge.check_finite``).
    ``owned``: ``delta`` holds float32 arrays the caller gives up; the sum and then the new residual
    are computed in them (the same values, without two more copies of the fragment)."""
    c = compensate(delta, residual, in_place=owned)
    fields = codec.Fields(fragment, base_version, kind, quantizer, block_size)
    blob, parts = codec.encode_with_parts(c, fields)
    # what the receiver decodes, from the parts the blob was made of (not by reading it back)
    decoded = {n: codec.dequantized(parts[n], quantizer, block_size) for n in c}
    del parts
    if owned:
        rest = {n: np.subtract(c[n], decoded[n], out=c[n]) for n in c}
    else:
        rest = {n: c[n] - decoded[n] for n in c}
    return Encoded(blob, decoded, rest, fragment, base_version, quantizer)
