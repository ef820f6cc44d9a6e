"""Where the files of a token corpus come from: ``stdlib``, a local file or folder, or an S3 prefix whose
objects are downloaded one by one into a local cache folder, each only when it is first read.

A file is listed with its size and a version (an S3 object's ETag, a local file's modification time),
so a cached copy, or anything made from it, is found again for as long as the content is the same.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sysconfig
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .data import CorpusError, local_files, s3_listing

log = logging.getLogger("diloco_worker.data")
CACHE_FOLDER = "diloco-data"


def resolve_cache_dir(setting: str | None) -> Path:
    """``--data-cache-dir``, or ``diloco-data`` under the system's temporary folder; created if missing."""
    path = Path(setting) if setting else Path(tempfile.gettempdir()) / CACHE_FOLDER
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CorpusError(
            f"cannot create the data cache folder {str(path)!r} (--data-cache-dir): {exc}"
        ) from None
    return path


@dataclass
class SourceFile:
    """One file of the corpus. ``local()`` gives a local path holding its content, downloading it into
    the cache the first time (an S3 object); a local file is its own path."""

    name: str  # the path or s3://bucket/key, for messages
    size: int
    version: str  # changes with the content: an ETag, or a local file's size and modification time
    _fetch: Callable[[], Path] = field(repr=False)
    _path: Path | None = field(default=None, repr=False)

    def local(self) -> Path:
        if self._path is None:
            self._path = self._fetch()
        return self._path


def list_files(source: str, suffixes: Sequence[str], cache_dir: Path, what: str) -> list[SourceFile]:
    """The corpus' files whose names end with one of ``suffixes`` (any file if none), in sorted order:
    ``stdlib`` (this Python's standard library ``.py`` files), a file (taken whatever its name), a
    folder (with its subfolders) or ``s3://bucket/prefix``. None is an error naming ``what`` to give."""
    if source.startswith("s3://"):
        files = _s3_files(source, cache_dir)
    elif source == "stdlib":
        suffixes = (".py",)
        files = [local_file(p) for p in local_files(Path(sysconfig.get_paths()["stdlib"]))]
    else:
        root = Path(source)
        if not root.exists():
            raise CorpusError(f"corpus path {source!r} does not exist: {what}")
        files = [local_file(root)] if root.is_file() else [local_file(p) for p in local_files(root)]
        if root.is_file():
            return files
    chosen = [f for f in files if not suffixes or f.name.endswith(tuple(suffixes))]
    if not chosen:
        kinds = " or ".join(f"*{s}" for s in suffixes) or "any"
        raise CorpusError(f"corpus {source!r} holds no {kinds} files: {what}")
    return chosen


def one_file(source: str, cache_dir: Path, what: str) -> SourceFile:
    """The single file at a path or ``s3://bucket/key`` (a tokenizer, for one)."""
    if source.startswith("s3://"):
        found = [f for f in _s3_files(source, cache_dir) if f.name == source]
        if not found:
            raise CorpusError(f"no object {source}: {what}")
        return found[0]
    if not Path(source).is_file():
        raise CorpusError(f"{source!r} is not a file: {what}")
    return local_file(Path(source))


def local_folder(source: str, cache_dir: Path, what: str) -> Path:
    """A local folder holding the files of a folder or of ``s3://bucket/prefix/`` (a ``save_pretrained``
    model, say): a local folder is itself; an S3 prefix's objects are downloaded into the cache (each once,
    by its ETag) and linked under their names relative to the prefix, in a folder named by their
    versions, so a changed object gives a new folder and a reader never sees a mix."""
    if not source.startswith("s3://"):
        if not Path(source).is_dir():
            raise CorpusError(f"{source!r} is not a folder: {what}")
        return Path(source)
    prefix = source.rstrip("/") + "/"
    files = _s3_files(prefix, cache_dir)  # listed by the prefix, so every name starts with it
    if not files:
        raise CorpusError(f"no object under {prefix}: {what}")
    folder = cache_dir / "folders" / file_key(prefix, *(f"{f.name}\0{f.version}" for f in files))
    if folder.is_dir():
        return folder
    part = folder.with_name(f"{folder.name}.{os.getpid()}.part")  # renamed whole: never seen half made
    shutil.rmtree(part, ignore_errors=True)
    for f in files:
        link = part / f.name.removeprefix(prefix)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(f.local())
    try:
        os.rename(part, folder)
    except OSError:  # another process made it meanwhile
        shutil.rmtree(part, ignore_errors=True)
    return folder


def local_file(path: Path) -> SourceFile:
    """A local file as a source (its own path; versioned by its size and modification time)."""
    stat = path.stat()
    return SourceFile(str(path), stat.st_size, f"{stat.st_size}-{stat.st_mtime_ns}", lambda: path)


def _s3_files(url: str, cache_dir: Path) -> list[SourceFile]:
    client, bucket, objects = s3_listing(url)
    files = []
    for o in objects:
        size, etag = int(o["Size"]), str(o.get("ETag", "")).strip('"')
        files.append(
            SourceFile(
                f"s3://{bucket}/{o['Key']}",
                size,
                etag,
                _Download(client, bucket, o["Key"], size, etag, cache_dir),
            )
        )
    return files


@dataclass(frozen=True)
class _Download:
    """An S3 object's copy in the cache, keyed by its name and ETag: downloaded once (to a temporary
    name, then renamed, so that processes sharing the cache never read half a file)."""

    client: Any
    bucket: str
    key: str
    size: int
    etag: str
    cache_dir: Path

    def __call__(self) -> Path:
        digest = hashlib.sha256(f"{self.bucket}/{self.key}\0{self.etag}".encode()).hexdigest()[:24]
        path = self.cache_dir / "s3" / f"{digest}{Path(self.key).suffix}"
        if path.is_file() and path.stat().st_size == self.size:
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(f"{path.name}.{os.getpid()}.part")
        log.info("downloading s3://%s/%s (%d bytes) to %s", self.bucket, self.key, self.size, path)
        try:
            self.client.download_file(self.bucket, self.key, str(part))
            os.replace(part, path)
        except Exception as exc:
            part.unlink(missing_ok=True)
            raise CorpusError(
                f"cannot download s3://{self.bucket}/{self.key} into {path.parent}: {exc}"
            ) from exc
        return path


def file_key(*parts: object) -> str:
    """A short stable name for what ``parts`` (names, versions, settings) describe."""
    return hashlib.sha256("\0".join(str(p) for p in parts).encode()).hexdigest()[:24]
