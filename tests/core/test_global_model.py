"""Reading a job's global model back from its storage, as the synchronizer commits it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from diloco_core import codec
from diloco_core.fragments import TensorSpec, build_plan
from diloco_core.global_model import ExportError, read_global_model, shards_in
from diloco_core.layout import FragmentRecord, Layout
from diloco_core.storage import FilesystemStore
from diloco_sync.persistence import StateStore

SHAPES = [("emb.weight", (8, 4)), ("a.weight", (4, 4)), ("a.bias", (4,)), ("b.weight", (4, 6))]


def _plan(fragments: int = 2):  # type: ignore[no-untyped-def]
    return build_plan(SHAPES, fragments, 4, 1, embedding_names=("emb.weight",))


def _values(spec: TensorSpec, version: int) -> np.ndarray:
    return np.full(spec.shape, version + 0.5, dtype=np.float32)


def _commit(state: StateStore, plan, p: int, version: int) -> None:  # type: ignore[no-untyped-def]
    frag = plan.fragments[p]
    blob = codec.encode({t.name: _values(t, version) for t in frag.tensors}, fragment=p, base_version=version,
                        kind="params", quantizer="fp32")  # fmt: skip
    record = FragmentRecord(version=version, params_key=state.layout.params(p, version))
    state.commit_version(p, record, params_blob=blob, outer=None, round_log=None, count_round=version > 0)


def _job(root: Path, shards: dict[int, list[int]], versions: dict[int, int], job: str = "job-a"):  # type: ignore[no-untyped-def]
    store = FilesystemStore(root)
    plan = _plan()
    for shard, owned in shards.items():
        state = StateStore(store, shard, job)
        state.save_plan(plan.to_dict(), plan.hash())
        for p in owned:
            for v in range(versions[p] + 1):
                _commit(state, plan, p, v)
    return store, plan


def test_every_fragment_at_the_version_its_shards_manifest_commits(tmp_path: Path) -> None:
    store, plan = _job(tmp_path, {0: [0], 1: [1]}, {0: 3, 1: 5})
    assert shards_in(store) == [0, 1]
    g = read_global_model(store, "job-a")
    assert g.versions == {0: 3, 1: 5}
    assert g.job_id == "job-a"
    assert g.rounds == 3 + 5
    assert sorted(g.tensors) == sorted(name for name, _ in SHAPES)
    for frag in plan.fragments:
        for spec in frag.tensors:
            np.testing.assert_array_equal(g.tensors[spec.name], _values(spec, g.versions[frag.index]))


def test_what_is_not_a_complete_model_of_the_job_is_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="no synchronizer state"):
        read_global_model(FilesystemStore(tmp_path / "empty"))
    store, _ = _job(tmp_path / "one", {0: [0, 1]}, {0: 1, 1: 1})
    with pytest.raises(ExportError, match="holds job 'job-a', not 'job-b'"):
        read_global_model(store, "job-b")
    store, _ = _job(tmp_path / "half", {0: [0]}, {0: 2})
    with pytest.raises(ExportError, match=r"fragments \[1\] have no committed version"):
        read_global_model(store)


def test_a_version_gone_from_storage_is_an_error_not_a_mixed_model(tmp_path: Path) -> None:
    store, _ = _job(tmp_path, {0: [0, 1]}, {0: 2, 1: 2})
    store.delete(Layout(0).params(1, 2))  # collected, and no newer manifest names another version
    with pytest.raises(ExportError, match="cannot read the job's state"):
        read_global_model(store)


def test_a_corrupt_parameter_object_is_named(tmp_path: Path) -> None:
    store, _ = _job(tmp_path, {0: [0, 1]}, {0: 1, 1: 1})
    store.put(Layout(0).params(0, 1), b"not a payload")
    with pytest.raises(ExportError, match="shard 0"):
        read_global_model(store)
