"""flexorch.data.store.remote against moto's S3 server on 127.0.0.1, and the same reads of local files."""

from __future__ import annotations

import itertools
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from flexorch.data.errors import DataError
from flexorch.data.store.remote import (
    exists,
    fetch_small,
    is_remote,
    join,
    list_dir,
    open_range_source,
    upload_dir,
)
from tests.s3_server import free_port, s3_server

BIG = 20_000_000  # bytes; 8 MiB chunks: two whole chunks and a partial one
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server with bucket ``flexorch-test``; the AWS settings of the environment only inside this module."""
    with s3_server() as server:
        yield server


def _prefix(s3) -> str:
    return f"{s3.root}/t{next(_prefixes)}"


def _put(uri: str, data: bytes) -> None:
    import pyarrow.fs as pafs

    fs, path = pafs.FileSystem.from_uri(uri)
    with fs.open_output_stream(path) as f:
        f.write(data)


@pytest.fixture(scope="module")
def big(s3, tmp_path_factory):
    """A 20 MB random object, and its local copy."""
    data = np.random.default_rng(0).bytes(BIG)
    local = tmp_path_factory.mktemp("big") / "part-00000.bin"
    local.write_bytes(data)
    uri = f"{s3.root}/big/part-00000.bin"
    _put(uri, data)
    return SimpleNamespace(uri=uri, local=local, data=data)


def _chunk_files(cache: Path) -> list[Path]:
    return [p for p in (cache / "chunks").iterdir() if ".tmp." not in p.name]


def _ranges(size: int, chunk: int, rng: np.random.Generator, n: int = 40) -> list[tuple[int, int]]:
    fixed = [(0, 0), (size, 0), (0, 10), (chunk - 5, 10), (2 * chunk - 1, 2), (chunk, chunk), (size - 7, 7)]
    fixed += [(size - (size % chunk) - 3, size % chunk + 3), (0, size)]
    starts = rng.integers(0, size, n)
    return fixed + [(int(s), int(rng.integers(0, min(3 << 20, size - s) + 1))) for s in starts]


def test_is_remote_and_join():
    assert is_remote("s3://b/p") and is_remote("gs://b/p")
    assert not is_remote("/data/store") and not is_remote("file:///data/store") and not is_remote("rel/dir")
    assert join("s3://b/p/", "shards", "part-00000.bin") == "s3://b/p/shards/part-00000.bin"
    assert join("s3://b/p?endpoint_override=h:1", "m.json") == "s3://b/p/m.json?endpoint_override=h:1"


def test_upload_dir_and_fetch_small(s3, tmp_path):
    src = tmp_path / "store"
    (src / "shards").mkdir(parents=True)
    (src / "manifest.json").write_text('{"version": 1}')
    np.save(src / "doc_index.npy", np.arange(1000, dtype=np.int64))
    (src / "shards" / "part-00000.bin").write_bytes(np.arange(5000, dtype=np.uint16).tobytes())
    root = _prefix(s3)
    upload_dir(str(src), root)
    assert list_dir(root) == ["doc_index.npy", "manifest.json", "shards/part-00000.bin"]
    assert exists(join(root, "manifest.json")) and not exists(join(root, "nope.json"))

    cache = tmp_path / "cache"
    path = fetch_small(join(root, "manifest.json"), cache_dir=str(cache))
    assert Path(path).read_bytes() == b'{"version": 1}' and Path(path).is_relative_to(cache)
    st = os.stat(path)
    again = fetch_small(join(root, "manifest.json"), cache_dir=str(cache))
    assert again == path and os.stat(again).st_ino == st.st_ino and os.stat(again).st_mtime_ns == st.st_mtime_ns
    np.testing.assert_array_equal(np.load(fetch_small(join(root, "doc_index.npy"), str(cache))), np.arange(1000))
    with open_range_source(join(root, "shards", "part-00000.bin"), cache_dir=str(cache)) as src_:
        assert src_.size == 10000
        assert np.frombuffer(src_.read(200, 20), np.uint16).tolist() == list(range(100, 110))
    upload_dir(str(src), str(tmp_path / "copy"))  # a local destination: same tree
    assert list_dir(str(tmp_path / "copy")) == list_dir(root) == list_dir((tmp_path / "copy").as_uri())


@pytest.mark.parametrize("where", ["remote", "local", "file_uri"])
def test_random_reads_match(where, big, tmp_path):
    uri = {"remote": big.uri, "local": str(big.local), "file_uri": big.local.as_uri()}[where]
    cache = tmp_path / "cache"
    chunk = 8 << 20
    src = open_range_source(uri, cache_dir=str(cache))
    assert src.size == BIG
    for offset, nbytes in _ranges(BIG, chunk, np.random.default_rng(1)):
        got = src.read(offset, nbytes)
        assert got == big.data[offset : offset + nbytes], (offset, nbytes)
    for offset, nbytes in [(BIG - 1, 2), (-1, 1), (0, BIG + 1)]:
        with pytest.raises(ValueError, match="part-00000.bin"):
            src.read(offset, nbytes)
    clone = pickle.loads(pickle.dumps(src))  # what a Ray worker would receive
    assert clone.read(chunk - 3, 6) == big.data[chunk - 3 : chunk + 3]
    src.close()
    if where == "remote":  # every chunk fetched once, cached whole
        assert sorted(p.stat().st_size for p in _chunk_files(cache)) == [BIG - 2 * chunk, chunk, chunk]
    else:
        assert not cache.exists()
        assert fetch_small(uri) == str(big.local)


def test_cache_stays_bounded_and_lru(big, tmp_path):
    cache = tmp_path / "cache"
    mib = 1 << 20
    src = open_range_source(big.uri, cache_dir=str(cache), cache_bytes=3 * mib, chunk_bytes=mib)
    rng = np.random.default_rng(2)
    for _ in range(30):
        offset = int(rng.integers(0, BIG - 4096))
        nbytes = int(rng.integers(1, mib))
        nbytes = min(nbytes, BIG - offset)
        assert src.read(offset, nbytes) == big.data[offset : offset + nbytes]
        assert sum(p.stat().st_size for p in _chunk_files(cache)) <= 3 * mib
    # least recently *read* goes first: after 5, 6, 5 (re-read), 7, 8 the cache keeps 5, 7, 8
    for idx in (5, 6, 5, 7, 8):
        assert src.read(idx * mib + 10, 10) == big.data[idx * mib + 10 : idx * mib + 20]
        time.sleep(0.02)  # file mtimes tick with the kernel's coarse clock
    key = _chunk_files(cache)[0].name.split(".")[0]
    assert sorted(int(p.name.split(".")[1]) for p in _chunk_files(cache) if p.name.startswith(key)) == [5, 7, 8]


_WORKER = """
import sys, numpy as np
from flexorch.data.store.remote import open_range_source
uri, local, cache, seed = sys.argv[1:]
data = open(local, "rb").read()
src = open_range_source(uri, cache_dir=cache, cache_bytes=3 << 20, chunk_bytes=1 << 20)
rng = np.random.default_rng(int(seed))
for _ in range(15):
    offset = int(rng.integers(0, len(data) - 1)); nbytes = int(rng.integers(0, min(2 << 20, len(data) - offset)))
    assert src.read(offset, nbytes) == data[offset : offset + nbytes], (offset, nbytes)
"""


def test_processes_share_the_cache(big, tmp_path):
    """Workers on one host reading through one cache directory (fetches, renames and evictions interleave)."""
    cache = tmp_path / "cache"
    procs = [
        subprocess.Popen([sys.executable, "-c", _WORKER, big.uri, str(big.local), str(cache), str(seed)])
        for seed in range(2)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    assert sum(p.stat().st_size for p in _chunk_files(cache)) <= 3 << 20
    assert not [p for p in (cache / "chunks").iterdir() if ".tmp." in p.name]


@pytest.mark.parametrize("new_size", [1500, 1000])
def test_changed_object_is_not_served_stale(new_size, s3, tmp_path):
    uri = join(_prefix(s3), "part-00000.bin")
    cache = str(tmp_path / "cache")
    old, new = b"a" * 1000, b"b" * new_size
    _put(uri, old)
    with open_range_source(uri, cache_dir=cache) as src:
        assert src.read(0, 1000) == old
    old_small = fetch_small(uri, cache)
    _put(uri, new)  # same size: a new ETag tells it apart
    with open_range_source(uri, cache_dir=cache) as src:
        assert src.size == new_size and src.read(0, new_size) == new
    new_small = fetch_small(uri, cache)
    assert new_small != old_small and Path(new_small).read_bytes() == new


def test_missing_object_and_bucket(s3, tmp_path):
    missing = join(_prefix(s3), "shards", "part-00042.bin")
    for call in (open_range_source, fetch_small):
        with pytest.raises(DataError, match="part-00042.bin: no such object"):
            call(missing, cache_dir=str(tmp_path))
    with pytest.raises(DataError, match=r"s3://no-such-bucket/x\.bin: the bucket 'no-such-bucket' does not exist"):
        open_range_source("s3://no-such-bucket/x.bin", cache_dir=str(tmp_path))
    with pytest.raises(DataError, match="no such file"):
        open_range_source(str(tmp_path / "absent.bin"))
    with pytest.raises(DataError, match="no such file"):
        fetch_small(str(tmp_path / "absent.json"))


@pytest.mark.parametrize(
    ("message", "says"),
    [
        ("AWS Error ACCESS_DENIED during HeadObject operation: No response body.", "AWS_ACCESS_KEY_ID"),
        ("AWS Error INVALID_ACCESS_KEY_ID during GetObject operation: InvalidAccessKeyId", "AWS_ACCESS_KEY_ID"),
        ("AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 6, Couldn't resolve host", "reach"),
        ("When getting information for key 'k' in bucket 'b': AWS Error NO_SUCH_KEY: not found", "no such object"),
    ],
)
def test_error_messages_say_what_to_set(message, says):
    from flexorch.data.store.remote import store_error

    err = store_error("s3://b/k", OSError(message))
    assert isinstance(err, DataError) and str(err).startswith("s3://b/k: ") and says in str(err)


def test_flexorch_s3_endpoint(s3, big, monkeypatch):
    """FLEXORCH_S3_ENDPOINT alone reaches the server (whatever pyarrow does with the AWS_ENDPOINT_URL* variables)."""
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.setenv("FLEXORCH_S3_ENDPOINT", s3.endpoint)
    assert exists(big.uri)


@pytest.mark.slow
def test_unreachable_endpoint_says_what_to_set(s3, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(DataError, match=r"s3://flexorch-test/x\.bin: cannot reach .*FLEXORCH_S3_ENDPOINT"):
        open_range_source("s3://flexorch-test/x.bin", cache_dir=str(tmp_path))
    assert time.monotonic() - t0 < 30


def test_a_store_uploaded_to_s3_trains_from_range_reads_like_the_local_one(s3, tmp_path):
    import json

    from flexorch.config import CorpusConfig
    from flexorch.data.corpus import load_corpus, open_store
    from flexorch.data.store.prepare import prepare_store

    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": f"record {i} " + "z" * (i % 97)}) + "\n" for i in range(3000)))
    prepare_store(CorpusConfig(source=str(src), max_context=64), tmp_path / "store", parallelism=0, unit_bytes=50_000)
    uri = f"{_prefix(s3)}/store"
    upload_dir(str(tmp_path / "store"), uri)
    here = open_store(tmp_path / "store")
    there = load_corpus(CorpusConfig(source=uri, max_context=64))  # a store URI as the run's source
    assert there.store == uri and there.blocks[0].path.startswith("s3://") and len(there.blocks) > 3
    assert there.keys == here.keys and np.array_equal(there.lengths, here.lengths)
    ids = list(range(0, here.num_docs, 7))
    for a, b in zip(here.get_stored(ids), there.get_stored(ids), strict=True):
        assert np.array_equal(a, b)
    with pytest.raises(DataError, match="manifest.json"):
        open_store(f"{_prefix(s3)}/no-store")
