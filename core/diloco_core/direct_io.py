"""Large objects written and read past the page cache (``O_DIRECT``).

The folder store's large objects (a version's parameters, its outer state, a checkpoint's tensors)
are written once and read back at most a few times, by a round that reads them whole into memory of
its own. Through the page cache each of their bytes is copied into a page the kernel allocates for
the file, and those pages are freed again when the object is collected: on a virtual machine that
hands freed memory back to its host, every such page costs a fault from the host when it is taken
again, more than the copy. Written and read with ``O_DIRECT`` the bytes go between the disk and the
process's own memory (a staging block, reused by later writers, on the way out; the reader's
array on the way in).

Where a filesystem refuses ``O_DIRECT`` (at ``open``, or on a write or read), the same object is written or
read through the page cache instead, from where it stopped: the result is the same file either way.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from pathlib import Path

import numpy as np

ALIGN = 4096  # offsets, lengths and buffer addresses of O_DIRECT I/O: a multiple of any block size
DIRECT_MIN_BYTES = 8 << 20  # objects at least this large bypass the page cache
STAGE_BYTES = 4 << 20  # the staging block a writer gathers pieces into (a multiple of ALIGN)
_READ_PIECE = 64 << 20  # bytes asked of one pread

_KEPT_BLOCKS = 4  # staging blocks kept for later writers once their writers are done
_free_blocks: list[mmap.mmap] = []
_blocks_lock = threading.Lock()


def _take_block() -> mmap.mmap:
    """A staging block of page-aligned anonymous memory for one writer: one a finished writer gave
    back (its pages already in memory), else a new one."""
    with _blocks_lock:
        if _free_blocks:
            return _free_blocks.pop()
    return mmap.mmap(-1, STAGE_BYTES)


def _give_back(block: mmap.mmap) -> None:
    with _blocks_lock:
        if len(_free_blocks) < _KEPT_BLOCKS:
            _free_blocks.append(block)
            return
    block.close()


def open_direct(path: str | Path, flags: int) -> int | None:
    """``path`` opened with ``O_DIRECT`` added to ``flags``; None where the filesystem (or the
    platform) does not take it."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return None
    try:
        return os.open(path, flags | direct)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise


class DirectWriter:
    """The bytes of one file written from offset 0 in whole aligned blocks through ``direct_fd``,
    gathered in a staging block of its own; the file's ordinary descriptor ``plain_fd`` takes what
    the direct one refuses, and sets the file's length at ``finish``. Either descriptor
    stays its caller's to close."""

    def __init__(self, direct_fd: int | None, plain_fd: int) -> None:
        self.direct_fd, self.plain_fd = direct_fd, plain_fd
        self.size = 0  # bytes taken
        self._written = 0  # bytes in the file
        self._filled = 0  # bytes in the staging block
        self._block = _take_block() if direct_fd is not None else None  # this writer's alone until closed
        self._view = memoryview(self._block) if self._block is not None else None
        self.direct = direct_fd is not None  # False once the direct descriptor refused a block

    def write(self, data: bytes | bytearray | memoryview) -> None:
        src = memoryview(data).cast("B")
        self.size += src.nbytes
        if self._view is None:
            self._pwrite_plain(src)
            return
        while src.nbytes:
            n = min(src.nbytes, STAGE_BYTES - self._filled)
            self._view[self._filled : self._filled + n] = src[:n]
            self._filled += n
            src = src[n:]
            if self._filled == STAGE_BYTES:
                self._emit(STAGE_BYTES)
            if self._view is None:  # the direct descriptor refused a block: the rest goes plainly
                self._pwrite_plain(src)
                return

    def patch(self, offset: int, data: bytes) -> None:
        """Bytes already taken written again at ``offset`` (a head known once the rest is written):
        what is in the file through its ordinary descriptor, what is still staged in the block."""
        end = offset + len(data)
        if offset < 0 or end > self.size:
            raise ValueError(f"a patch of {offset}..{end} outside the {self.size} bytes written")
        in_file = max(0, min(end, self._written) - offset)
        if in_file:
            _pwrite_all(self.plain_fd, memoryview(data)[:in_file], offset)
        if in_file < len(data):
            assert self._view is not None  # bytes past the file's are in the staging block
            at = offset + in_file - self._written
            self._view[at : at + len(data) - in_file] = data[in_file:]

    def finish(self) -> None:
        """The last bytes written (the direct block padded to ``ALIGN``), then the file cut to its
        length; syncing it is its owner's (the folder store's commit)."""
        if self._view is not None and self._filled:
            tail = self._filled
            padded = -(-tail // ALIGN) * ALIGN
            self._view[tail:padded] = bytes(padded - tail)
            self._emit(padded, keep=tail)
        os.ftruncate(self.plain_fd, self.size)

    def close(self) -> None:
        """Give the staging block back for another writer (nothing to write may be left in it)."""
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._block is not None:
            _give_back(self._block)
            self._block = None

    def _emit(self, length: int, keep: int | None = None) -> None:
        """The staging block's first ``length`` bytes into the file (``keep``: how many of them are
        the object's, the rest padding)."""
        assert self._view is not None
        assert self.direct_fd is not None
        block = self._view[:length]
        end = length if keep is None else keep
        done, refused = 0, None
        try:
            while done < length:
                done += os.pwrite(self.direct_fd, block[done:], self._written + done)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            refused = bytes(block[done:end])
        finally:
            block.release()
        if refused is None:
            self._written += end
            self._filled = 0
            return
        self._written += done
        self.close()  # the block is let go: the rest goes through the ordinary descriptor
        self.direct = False
        self._pwrite_plain(memoryview(refused))

    def _pwrite_plain(self, src: memoryview) -> None:
        _pwrite_all(self.plain_fd, src, self._written)
        self._written += src.nbytes


def _pwrite_all(fd: int, src: memoryview, offset: int) -> None:
    done = 0
    while done < src.nbytes:
        done += os.pwrite(fd, src[done:], offset + done)


def read_direct(path: str | Path) -> memoryview | None:
    """The whole file read past the page cache into a fresh array, as a read-only view of its bytes;
    None where the filesystem does not take ``O_DIRECT`` reads. ``OSError`` for a file that cannot
    be opened or read otherwise."""
    fd = open_direct(path, os.O_RDONLY)
    if fd is None:
        return None
    try:
        size = os.fstat(fd).st_size
        held = np.empty(size + 2 * ALIGN, np.uint8)
        start = (-held.ctypes.data) % ALIGN
        region = held[start : start + -(-size // ALIGN) * ALIGN].data
        got = 0
        try:
            while got < size:
                n = os.preadv(fd, [region[got : got + _READ_PIECE]], got)
                if n == 0:
                    raise OSError(errno.EIO, f"{path} ended at {got} of its {size} bytes")
                got += n
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return None
            raise
        return region[:size].toreadonly()
    finally:
        os.close(fd)
