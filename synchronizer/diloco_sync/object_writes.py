"""A commit's objects as they are written: bytes, or what a writer writes into the object's upload as
it is made, so that a large object (the outer state) is never held whole."""

from __future__ import annotations

from collections.abc import Callable

from diloco_core.storage import ObjectStore, StorageUnavailable
from diloco_core.uploads import Upload

Writer = Callable[[Upload], int]
"""What writes an object into its upload, returning the object's size."""
Contents = bytes | bytearray | Writer


def put_contents(store: ObjectStore, key: str, data: Contents) -> int:
    """Store bytes, or what ``data`` writes into the object's upload (an upload that cannot be
    written is ``StorageUnavailable``, as any storage failure); the object's size."""
    if not callable(data):
        store.put(key, data)
        return len(data)
    upload = store.open_upload(key, read_back=False)  # only stored: past the cache where that is possible
    try:
        size = data(upload)
        upload.commit()
        return size
    except OSError as exc:
        raise StorageUnavailable(f"writing {key}: {exc}") from exc
    finally:
        upload.discard()
