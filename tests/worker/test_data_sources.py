"""Where token files come from: local files and folders, and S3 objects downloaded only when first read."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from diloco_core.config import DataSettings
from diloco_testbed.s3_server import S3Server
from diloco_worker.data import CorpusError
from diloco_worker.data_sources import list_files, local_folder, resolve_cache_dir
from diloco_worker.tokens import open_token_corpus


def test_a_folder_lists_its_files_with_the_suffix_in_sorted_order_subfolders_included(tmp_path: Path) -> None:
    for name in ("b.bin", "a.bin", "sub/c.bin", "notes.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"\x00\x00")
    files = list_files(str(tmp_path), (".bin",), tmp_path / "cache", "say what")
    assert [Path(f.name).relative_to(tmp_path).as_posix() for f in files] == ["a.bin", "b.bin", "sub/c.bin"]
    assert all(f.local() == Path(f.name) and f.size == 2 for f in files)
    # a file named on its own is taken whatever its suffix
    assert [f.name for f in list_files(str(tmp_path / "notes.txt"), (".bin",), tmp_path, "x")] == [
        str(tmp_path / "notes.txt")
    ]


def test_a_missing_path_or_no_matching_file_is_an_error_saying_what_to_give(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="'/no/such/corpus' does not exist: give a corpus"):
        list_files("/no/such/corpus", (".bin",), tmp_path, "give a corpus")
    with pytest.raises(CorpusError, match=r"holds no \*\.parquet or \*\.arrow files: give a corpus"):
        list_files(str(tmp_path), (".parquet", ".arrow"), tmp_path, "give a corpus")


def test_the_cache_folder_defaults_under_the_temporary_folder(tmp_path: Path) -> None:
    assert resolve_cache_dir(None).name == "diloco-data"
    assert resolve_cache_dir(str(tmp_path / "a" / "b")).is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(CorpusError, match="cannot create the data cache folder"):
        resolve_cache_dir(str(tmp_path / "file" / "sub"))


@pytest.fixture
def s3_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    return s3


@pytest.mark.integration
def test_s3_shards_are_downloaded_one_by_one_only_when_a_window_of_them_is_read(
    s3_env: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bucket = s3_env.new_bucket("tokens")
    client = s3_env.client()
    shards = {name: np.arange(i * 1000, i * 1000 + 24, dtype=np.uint16) for i, name in enumerate("abc")}
    for name, ids in shards.items():  # 3 windows of 8 ids each
        client.put_object(Bucket=bucket, Key=f"tok/{name}.bin", Body=ids.tobytes())
    client.put_object(Bucket=bucket, Key="tok/meta.json", Body=b"{}")
    client.put_object(Bucket=bucket, Key="other/d.bin", Body=shards["a"].tobytes())
    data = DataSettings(corpus=f"s3://{bucket}/tok/", format="tokens", cache_dir=str(tmp_path / "cache"))

    corpus = open_token_corpus(data, block_size=7, vocab_size=4000)
    assert corpus.n_windows == 9  # from the listed sizes: nothing downloaded yet
    assert not (tmp_path / "cache" / "s3").exists()
    rows = corpus.rows(np.array([4, 5]))  # windows 1 and 2 of b.bin
    assert rows.tolist() == [shards["b"][8:16].tolist(), shards["b"][16:24].tolist()]
    assert len(list((tmp_path / "cache" / "s3").iterdir())) == 1  # b.bin only

    caplog.clear()  # the first download's line too, where an earlier test left the root logger at INFO
    with caplog.at_level(logging.INFO, logger="diloco_worker.data"):
        again = open_token_corpus(data, block_size=7, vocab_size=4000)
        assert again.rows(np.array([3])).tolist() == [shards["b"][:8].tolist()]
    assert not [r for r in caplog.records if "downloading" in r.getMessage()]  # the cached copy
    assert again.rows(np.array([8])).tolist() == [shards["c"][16:].tolist()]
    assert len(list((tmp_path / "cache" / "s3").iterdir())) == 2


@pytest.mark.integration
def test_an_s3_folder_comes_down_once_as_a_local_folder_under_its_own_names(
    s3_env: S3Server, tmp_path: Path
) -> None:
    """What ``HF_INIT_FROM=s3://...`` (a ``save_pretrained`` folder to continue from) is read through:
    the objects under the prefix, linked under their names relative to it; a changed object makes a
    new folder; a prefix that is only the start of another folder's name is not that folder."""
    bucket = s3_env.new_bucket("models")
    client = s3_env.client()
    client.put_object(Bucket=bucket, Key="run/hf/config.json", Body=b"{}")
    client.put_object(Bucket=bucket, Key="run/hf/sub/weights.bin", Body=b"w1")
    client.put_object(Bucket=bucket, Key="run/hf2/other.json", Body=b"x")
    cache = tmp_path / "cache"
    folder = local_folder(f"s3://{bucket}/run/hf", cache, "a model")
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == [
        "config.json", "sub/weights.bin",
    ]  # fmt: skip
    assert (folder / "sub" / "weights.bin").read_bytes() == b"w1"
    assert local_folder(f"s3://{bucket}/run/hf/", cache, "a model") == folder  # found again, not remade
    client.put_object(Bucket=bucket, Key="run/hf/sub/weights.bin", Body=b"w2")
    changed = local_folder(f"s3://{bucket}/run/hf", cache, "a model")
    assert changed != folder
    assert (changed / "sub" / "weights.bin").read_bytes() == b"w2"
    assert (folder / "sub" / "weights.bin").read_bytes() == b"w1"  # a reader of the old one is undisturbed
    with pytest.raises(CorpusError, match="no object under"):
        local_folder(f"s3://{bucket}/nothing", cache, "a model")
    with pytest.raises(CorpusError, match="is not a folder: a model"):
        local_folder(str(tmp_path / "missing"), cache, "a model")
    assert local_folder(str(tmp_path), cache, "a model") == tmp_path
