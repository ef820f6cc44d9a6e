"""A fragment's state between its rounds as raw float32 in a local file, read back by its next round
instead of decoding the committed objects.

A fragment whose versions are served from storage does not hold its parameters and outer state
between rounds (``held_state``): its next round used to read them back from the committed objects,
which costs a download from S3 and a decode (zstd, the checksum, joining the byte planes) of every
value. ``StateCopy.write`` keeps the arrays the round just committed in an unnamed temporary file
(``O_TMPFILE``: a crash leaves nothing behind, closing it frees it), each array's bytes as they are
with an ``xxh3_64`` checksum; ``read`` gives them back, checked. The kernel keeps the file in its page
cache while memory allows and on the local disk otherwise: the process does not hold it.

The copy is never the durable state, only a faster way to the state the committed objects hold bit
for bit: a copy that cannot be written (a full disk) is not made, and one that cannot be read back
whole and unchanged raises ``OSError``, after which the round reads the committed objects.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np
import numpy.typing as npt
import xxhash
from diloco_core import direct_io

Arrays = Mapping[str, npt.NDArray[np.float32]]
LOCAL_FOLDER = Path(tempfile.gettempdir(), "diloco-state")  # where the copies are made (TMPDIR's)
_IO_MAX = 1 << 30  # bytes per read or write call (Linux moves at most about 2 GiB per call)


@dataclass(frozen=True)
class Slot:
    """Where one array lies in the file, and what it must read back as."""

    group: str
    name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksum: int


def layout(groups: Mapping[str, Arrays]) -> list[tuple[str, str, npt.NDArray[np.float32], int]]:
    """The arrays of each group (``group``, ``name``, array as contiguous float32, offset), one
    after another in the order given; ``TypeError`` for an array that is not float32."""
    out: list[tuple[str, str, npt.NDArray[np.float32], int]] = []
    offset = 0
    for group, arrays in groups.items():
        for name, value in arrays.items():
            if value.dtype != np.float32:
                raise TypeError(f"{group}/{name} is {value.dtype}: the state is float32")
            arr = np.ascontiguousarray(value)
            out.append((group, name, arr, offset))
            offset += arr.nbytes
    return out


class StateCopy:
    """Groups of named float32 arrays (``params``, ``outer``) in an unnamed local file."""

    def __init__(self, file: IO[bytes], slots: tuple[Slot, ...]) -> None:
        self._file: IO[bytes] | None = file
        self.slots = slots
        self.nbytes = sum(s.nbytes for s in slots)

    @classmethod
    def write(cls, folder: Path, groups: Mapping[str, Arrays]) -> StateCopy:
        """The arrays written to a new unnamed file in ``folder`` (blocking), past the page cache
        where the filesystem takes it (``direct_io``: its pages would be taken from the host and
        given back every round); ``OSError`` when they cannot be (nothing is left behind)."""
        placed = layout(groups)
        folder.mkdir(parents=True, exist_ok=True)
        file = tempfile.TemporaryFile(dir=folder)  # noqa: SIM115  # kept open: the copy lives in it
        direct_fd: int | None = None
        writer: direct_io.DirectWriter | None = None
        try:
            direct_fd = direct_io.open_direct(_path(file), os.O_WRONLY)
            writer = direct_io.DirectWriter(direct_fd, file.fileno())
            slots = []
            for group, name, arr, offset in placed:
                data = arr.reshape(-1).view(np.uint8).data
                writer.write(data)
                slots.append(Slot(group, name, arr.shape, offset, arr.nbytes, xxhash.xxh3_64_intdigest(data)))
            writer.finish()
        except BaseException:
            file.close()
            raise
        finally:
            if writer is not None:
                writer.close()
            if direct_fd is not None:
                os.close(direct_fd)
        return cls(file, tuple(slots))

    def read(self) -> dict[str, dict[str, npt.NDArray[np.float32]]]:
        """The groups as written, in new arrays (blocking; past the page cache where the filesystem
        takes it); ``OSError`` when the file cannot be read whole, or an array's bytes are not those
        written."""
        if self._file is None:
            raise OSError("the state's local copy is closed")
        held = direct_io.read_direct_array(_path(self._file))
        if held is None:
            held = np.empty(self.nbytes, np.uint8)
            _read_all(self._file.fileno(), held.data)
        if len(held) != self.nbytes:
            raise OSError(f"the state's local copy holds {len(held)} bytes, not the {self.nbytes} written")
        out: dict[str, dict[str, npt.NDArray[np.float32]]] = {}
        for s in self.slots:
            data = held[s.offset : s.offset + s.nbytes]
            if xxhash.xxh3_64_intdigest(data.data) != s.checksum:
                raise OSError(f"{s.group}/{s.name} in the state's local copy is not what was written")
            out.setdefault(s.group, {})[s.name] = data.view(np.float32).reshape(s.shape)
        return out

    @property
    def closed(self) -> bool:
        return self._file is None

    def close(self) -> None:
        """Free the file (nothing once closed)."""
        if self._file is not None:
            file, self._file = self._file, None
            file.close()


def _path(file: IO[bytes]) -> str:
    """A name that opens the unnamed file again (with other flags)."""
    return f"/proc/self/fd/{file.fileno()}"


def _read_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        got = os.preadv(fd, [data[done : done + _IO_MAX]], done)
        if got <= 0:
            raise OSError(f"the state's local copy ends at {done}, before its last array")
        done += got
