"""TensorBoard's event-file format, written without TensorFlow or TensorBoard.

An event file is a sequence of TFRecords (length, masked CRC-32C of the length, data, masked CRC-32C
of the data), each holding one serialised ``tensorboard.Event``: the first says the file's version,
the others carry scalar summaries. Only the few protobuf fields a scalar needs are encoded here:

    Event:   wall_time = 1 (double), step = 2 (int64), file_version = 3 (string), summary = 5
    Summary: value = 1 (repeated Value);  Value: tag = 1 (string), simple_value = 2 (float)

TensorBoard's own reader is the reference (tests read these files back with it).
"""

from __future__ import annotations

import math
import os
import socket
import struct
from collections.abc import Mapping

FILE_VERSION = "brain.Event:2"


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), the checksum of TFRecords."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tf_record(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # int64 as protobuf writes it
    out = bytearray()
    while True:
        bits, value = value & 0x7F, value >> 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _field(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _length_delimited(number: int, payload: bytes) -> bytes:
    return _field(number, 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, body: bytes) -> bytes:
    return _field(1, 1) + struct.pack("<d", wall_time) + _field(2, 0) + _varint(step) + body


def version_event(wall_time: float) -> bytes:
    """The record every event file starts with."""
    return tf_record(_event(wall_time, 0, _length_delimited(3, FILE_VERSION.encode())))


def scalars_event(wall_time: float, step: int, scalars: Mapping[str, float]) -> bytes:
    """One record holding a scalar per tag; values that are not finite are left out."""
    values = b"".join(
        _length_delimited(1, _length_delimited(1, tag.encode()) + _field(2, 5) + struct.pack("<f", value))
        for tag, value in scalars.items()
        if math.isfinite(value)
    )
    return tf_record(_event(wall_time, step, _length_delimited(5, values)))


def file_name(wall_time: float, suffix: str = "") -> str:
    """TensorBoard's naming (``events.out.tfevents.<time>.<host>.<pid><suffix>``); it reads a run's files
    in the order of their names."""
    return f"events.out.tfevents.{int(wall_time):010d}.{socket.gethostname()}.{os.getpid()}{suffix}"
