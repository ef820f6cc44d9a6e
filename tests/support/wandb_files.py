"""Reading a W&B offline run's ``.wandb`` file: W&B's LevelDB-style log of ``Record`` protobufs.

The file is a 7-byte header (``:W&B``, a magic number, a version) and then 32 KiB blocks of chunks,
each chunk a CRC-32 (4 bytes), a length (2), a type (1: whole, 2: first, 3: middle, 4: last) and the
bytes; a block's tail shorter than a chunk header is padding. The protobuf is W&B's own
(``wandb.proto.wandb_internal_pb2.Record``)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    out, pos, pending = [], HEADER, b""
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:  # padding at the end of a block
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # still being written
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def history(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """The logged rows, as (step, {key: value}) in order."""
    rows = []
    for r in records(path):
        if r.WhichOneof("record_type") == "history":
            items = ((i.key or "/".join(i.nested_key), i.value_json) for i in r.history.item)
            values = {key: json.loads(value) for key, value in items if not key.startswith("_")}
            rows.append((r.history.step.num, values))
    return rows


def config(path: Path) -> dict[str, Any]:
    """The run's config as the run record holds it."""
    for r in records(path):
        if r.WhichOneof("record_type") == "run":
            return {u.key: json.loads(u.value_json) for u in r.run.config.update if not u.key.startswith("_")}
    raise AssertionError("no run record")
