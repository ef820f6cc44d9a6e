"""Blocking reads and writes of the synchronizer's state (call from a worker thread, never the loop).

Commit protocol of a round (fragment p, new version v): parameters, outer state and the round log are
written first under new keys, then the manifest naming them. A crash before the manifest leaves the
old version in force; the orphans are collected by ``collect_garbage``. The storage prefix belongs
to one job (``diloco_core.ownership``): ``claim`` takes it at start-up, and every write of the state
first checks that it still does (``check_owner``); once another job holds it, nothing more is written.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from diloco_core.dealing import DealRecord
from diloco_core.layout import (
    FragmentRecord,
    Layout,
    LayoutError,
    LearnerRegistryRecord,
    Manifest,
    PendingMeta,
    pack_pending,
    pending_head,
    unpack_pending,
    version_of_key,
)
from diloco_core.ownership import (
    MARKER_KEY,
    JobMarker,
    MarkerUnreadable,
    claim_decision,
    conflict_message,
    encode_marker,
    new_marker,
    parse_marker,
)
from diloco_core.storage import ObjectNotFound, ObjectStore, StorageError, StorageUnavailable
from diloco_core.uploads import LOCAL_SPOOL, MemoryUpload, Upload, sweep

from .object_writes import Contents, Writer, put_contents

log = logging.getLogger(__name__)
_WRITERS = 3  # parameters, outer-optimizer state and round log of one commit


class StateMismatch(RuntimeError):
    """The stored state belongs to another job: starting would corrupt it, so refuse to start."""


class StorageOwnedByAnotherJob(StateMismatch):
    """Another job holds the storage prefix (its marker names another owner)."""


class StateStore:
    """One shard's durable state on an ``ObjectStore``. ``owner``: the job's identity in the prefix's
    marker (default: ``job_id``); ``on_lost(reason)`` is called once, from the thread that noticed,
    when another job took the prefix while this store was using it."""

    def __init__(
        self,
        store: ObjectStore,
        shard: int,
        job_id: str,
        owner: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.layout = Layout(shard)
        self.shard = shard
        self.job_id = job_id
        self.owner = owner or job_id
        self.clock = clock
        self.on_lost: Callable[[str], None] | None = None
        self._lost: str | None = None
        self._owner_lock = threading.Lock()
        self._manifest_lock = threading.Lock()
        self._committed: dict[int, FragmentRecord] = {}
        self._plan_hash = ""
        self._rounds = 0
        self._written_lock = threading.Lock()
        self._written: dict[int, set[str]] = {}  # per fragment: parameter/outer objects written here
        self._listed: set[int] = set()  # fragments whose stored objects were listed once
        self._writers = ThreadPoolExecutor(max_workers=_WRITERS, thread_name_prefix="state-writer")

    # -- the prefix's owner ---------------------------------------------------------------------

    @property
    def marker_location(self) -> str:
        return f"{self.store.describe()}/{MARKER_KEY}"

    def claim(self) -> JobMarker:
        """Take the storage prefix for this job before anything else is read or written: write the
        marker when there is none, then read it back (of two claiming at once, the last writer wins).
        Raises ``StorageOwnedByAnotherJob`` when another job holds it, ``StateMismatch`` when the
        marker cannot be read (it is not overwritten), ``StorageUnavailable`` to be retried."""
        where = self.marker_location
        existing = self._read_marker()
        decision = claim_decision(existing, self.owner)
        if existing is not None and decision == "refuse":
            raise StorageOwnedByAnotherJob(conflict_message(existing, self.owner, where))
        if existing is not None:
            return existing
        self.store.put(MARKER_KEY, encode_marker(new_marker(self.owner, self.job_id, self.clock())))
        back = self._read_marker()
        if back is None:
            raise StorageUnavailable(f"{where} was gone right after it was written")
        if claim_decision(back, self.owner) != "owned":
            raise StorageOwnedByAnotherJob(conflict_message(back, self.owner, where))
        log.info("storage prefix claimed for %s: %s", self.owner, where)
        return back

    def check_owner(self) -> None:
        """Before a write of the state: raise ``StorageOwnedByAnotherJob`` once another job holds the
        prefix, or its marker can no longer be read (for good: nothing more is written). A marker
        deleted meanwhile is claimed again."""
        self._ensure_kept()
        try:
            self.claim()
        except StateMismatch as exc:
            self._lose(str(exc))

    def _read_marker(self) -> JobMarker | None:
        try:
            raw = self.store.get(MARKER_KEY)
        except ObjectNotFound:
            return None
        try:
            return parse_marker(raw, self.marker_location)
        except MarkerUnreadable as exc:
            raise StateMismatch(str(exc)) from exc

    def _ensure_kept(self) -> None:
        """Raise ``StorageOwnedByAnotherJob`` when the prefix was lost (no storage call)."""
        if self._lost is not None:
            raise StorageOwnedByAnotherJob(self._lost)

    def _lose(self, reason: str) -> None:
        with self._owner_lock:
            first = self._lost is None
            if first:
                self._lost = reason
        if first:
            log.error("stopping all writes: %s", reason)
            if self.on_lost is not None:
                self.on_lost(reason)
        raise StorageOwnedByAnotherJob(reason)

    # -- reading at start-up -------------------------------------------------------------------

    def load_manifest(self) -> Manifest | None:
        try:
            raw = self.store.get(self.layout.manifest)
        except ObjectNotFound:
            return None
        manifest = Manifest.model_validate_json(raw)
        if manifest.job_id != self.job_id:
            raise StateMismatch(
                f"storage holds job {manifest.job_id!r}, this synchronizer serves {self.job_id!r}: "
                "use another storage prefix"
            )
        with self._manifest_lock:
            self._committed = dict(manifest.fragments)
            self._plan_hash = manifest.plan_hash
            self._rounds = manifest.rounds
        return manifest

    def load_plan(self) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = json.loads(self.store.get(self.layout.plan))
        except ObjectNotFound:
            return None
        return data

    def save_plan(self, plan: dict[str, Any], plan_hash: str) -> None:
        self.check_owner()
        self.store.put(self.layout.plan, json.dumps(plan, sort_keys=True).encode())
        with self._manifest_lock:
            self._plan_hash = plan_hash
            self._write_manifest_locked()

    def load_learners(self) -> LearnerRegistryRecord:
        try:
            return LearnerRegistryRecord.model_validate_json(self.store.get(self.layout.learners))
        except ObjectNotFound:
            return LearnerRegistryRecord()

    def save_learners(self, registry: LearnerRegistryRecord) -> None:
        self.check_owner()
        self.store.put(self.layout.learners, registry.model_dump_json().encode())

    def load_deal(self) -> DealRecord:
        try:
            return DealRecord.model_validate_json(self.store.get(self.layout.deal))
        except ObjectNotFound:
            return DealRecord()

    def save_deal(self, record: DealRecord) -> None:
        self.check_owner()
        self.store.put(self.layout.deal, record.model_dump_json().encode())

    def read(self, key: str) -> memoryview:
        """An object read whole for decoding (``ObjectStore.get_view``: a large one past the cache)."""
        return self.store.get_view(key)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        return self.store.read_range(key, start, length)

    def load_round_logs(self, wanted: list[tuple[int, int]]) -> list[dict[str, Any]]:
        """The round logs of these ``(fragment, version)`` pairs, read concurrently.

        A version without a log (the initial upload is not a round) or with an unreadable one is
        left out: the logs only feed the status's recent rounds.
        """

        def one(fragment: int, version: int) -> dict[str, Any] | None:
            try:
                entry = json.loads(self.store.get(self.layout.round_log(fragment, version)))
            except ObjectNotFound:
                return None
            except ValueError:
                log.warning(
                    "round log of fragment %d version %d is not valid JSON; skipped", fragment, version
                )
                return None
            return entry if isinstance(entry, dict) else None

        futures = [self._writers.submit(one, p, v) for p, v in wanted]
        return [entry for future in futures if (entry := future.result()) is not None]

    # -- pending contributions -----------------------------------------------------------------

    def start_pending(
        self, fragment: int, learner_id: str, base_version: int, seq: int, *, to_storage: bool
    ) -> Upload:
        """The pending object of a contribution, written as its payload arrives after a head kept
        for its metadata (``finish_pending``): a file where storage takes one, else (and without
        ``to_storage``) in memory."""
        key = self.layout.pending(fragment, learner_id, base_version, seq)
        upload: Upload | None = None
        if to_storage:
            try:
                self._ensure_kept()
                upload = self.store.open_upload(key)
            except StorageError as exc:
                log.info("contribution %s received in memory: %s", key, exc)
        if upload is None:
            upload = MemoryUpload(lambda data: self.store.put(key, data))
        upload.write(pending_head(None))
        return upload

    def finish_pending(self, upload: Upload, meta: PendingMeta) -> str:
        """Store a ``start_pending`` object with its metadata; its key. A failure (a file that cannot
        take the head is ``StorageUnavailable``) leaves it as it was."""
        key = self.layout.pending(meta.fragment, meta.learner_id, meta.base_version, meta.seq)
        self._ensure_kept()
        try:
            upload.patch(0, pending_head(meta))
            upload.commit()
        except OSError as exc:
            raise StorageUnavailable(f"writing {key}: {exc}") from exc
        return key

    def put_pending(self, meta: PendingMeta, payload: bytes) -> str:
        key = self.layout.pending(meta.fragment, meta.learner_id, meta.base_version, meta.seq)
        self._ensure_kept()
        self.store.put(key, pack_pending(meta, payload))
        return key

    def sweep_uploads(self) -> None:
        """Remove what unfinished uploads left in the shard (at start-up, as its one writer)."""
        try:
            removed = self.store.sweep_uploads(f"{self.layout.root}/") + sweep(LOCAL_SPOOL, idle_s=0.0)
        except (OSError, StorageError) as exc:
            if isinstance(exc, StorageUnavailable):
                raise
            log.warning("shard %d: could not remove unfinished uploads: %s", self.shard, exc)
            return
        if removed:
            log.info("shard %d: removed %d unfinished uploads", self.shard, removed)

    def list_pending(self) -> list[str]:
        return self.store.list(self.layout.pending_prefix)

    def get_pending(self, key: str) -> tuple[PendingMeta, bytes] | None:
        try:
            return unpack_pending(self.store.get(key))
        except ObjectNotFound:
            return None
        except LayoutError as exc:
            log.warning("dropping unreadable pending object %s: %s", key, exc)
            return None

    def delete(self, key: str) -> None:
        self._ensure_kept()
        self.store.delete(key)

    # -- commits -------------------------------------------------------------------------------

    def commit_version(
        self,
        fragment: int,
        record: FragmentRecord,
        *,
        params_blob: Contents,
        outer: Writer | None,
        round_log: dict[str, Any] | None,
        count_round: bool,
    ) -> FragmentRecord:
        """Write the objects of a new fragment version, then the manifest that makes it current; the
        record committed, its ``params_bytes`` the size of the parameters' object as written. The
        objects are independent, so they are written concurrently; the manifest only once all are
        durable. The prefix's owner is checked first. ``outer`` (and ``params_blob`` when it is a
        writer) writes its object into its upload as it is made (again on a retry)."""
        self.check_owner()
        objects: dict[str, Contents] = {record.params_key: params_blob}
        if outer is not None and record.outer_key is not None:
            objects[record.outer_key] = outer
        if round_log is not None:
            objects[self.layout.round_log(fragment, record.version)] = json.dumps(round_log).encode()
        self._remember(fragment, [key for key in objects if version_of_key(key) is not None])
        sizes = self._put_all(objects)
        record = record.model_copy(update={"params_bytes": sizes[record.params_key]})
        with self._manifest_lock:
            previous = self._committed.get(fragment)
            self._committed[fragment] = record
            if count_round:
                self._rounds += 1
            try:
                self._write_manifest_locked()
            except StorageError:
                # not committed: restore, so a retry writes the same manifest
                if previous is None:
                    self._committed.pop(fragment, None)
                else:
                    self._committed[fragment] = previous
                if count_round:
                    self._rounds -= 1
                raise
        return record

    def _put_all(self, objects: dict[str, Contents]) -> dict[str, int]:
        """Write every object, concurrently; their sizes. Raises the first failure after all writes ended."""
        futures = {key: self._writers.submit(put_contents, self.store, key, v) for key, v in objects.items()}
        wait(futures.values())
        return {key: future.result() for key, future in futures.items()}

    def _write_manifest_locked(self) -> None:
        manifest = Manifest(
            job_id=self.job_id,
            shard=self.shard,
            plan_hash=self._plan_hash,
            fragments=dict(self._committed),
            rounds=self._rounds,
        )
        self.store.put(self.layout.manifest, manifest.model_dump_json().encode())

    def collect_garbage(self, fragment: int, keep_versions: int) -> int:
        """Delete parameter/outer objects older than the newest ``keep_versions`` committed ones.

        The first call for a fragment lists its objects (orphans of an earlier process included);
        later calls only look at the objects this process wrote, so a round never lists the store.
        """
        self._ensure_kept()
        with self._manifest_lock:
            record = self._committed.get(fragment)
        if record is None:
            return 0
        oldest_kept = record.version - keep_versions + 1
        with self._written_lock:
            listed = fragment in self._listed
            keys = sorted(self._written.get(fragment, ()))
        if not listed:
            keys = self.store.list(self.layout.fragment_prefix(fragment))
            self._remember(fragment, [key for key in keys if version_of_key(key) is not None])
            with self._written_lock:
                self._listed.add(fragment)
        deleted = 0
        for key in keys:
            version = version_of_key(key)
            if version is not None and (version < oldest_kept or version > record.version):
                self.store.delete(key)
                deleted += 1
                with self._written_lock:
                    self._written.get(fragment, set()).discard(key)
        return deleted

    def _remember(self, fragment: int, keys: list[str]) -> None:
        """Objects of a fragment known to exist (remembered before writing: a failed write may leave one)."""
        with self._written_lock:
            self._written.setdefault(fragment, set()).update(keys)

    def probe(self) -> None:
        """Raise ``StorageUnavailable`` when the backend cannot be reached."""
        self.store.exists(self.layout.manifest)
