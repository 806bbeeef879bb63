"""Corpus loading with real Ray Data readers and Ray tasks (one local Ray instance for the module)."""

from __future__ import annotations

import json
import logging
import pickle
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flexorch.config import CorpusConfig
from flexorch.data.corpus import load_corpus
from flexorch.data.errors import DataError
from flexorch.data.store.blocks import BlockSpec, fetch_documents, open_blocks
from flexorch.data.store.prepare import prepare_store
from flexorch.data.tokenizer import ByteTokenizer
from flexorch.work.step import DocRef

BOS = ByteTokenizer.BOS
TEXTS = {
    "a.txt": b"hello world\n",
    "_top.py": b"x = 1\n",  # a leading underscore must not be skipped (Ray Data's own listing would)
    "sub/b.py": "print('h\u00e9')\n".encode(),
    "long.txt": b"0123456789abcdefghijklmnopqrstuvw",  # 33 bytes -> 34 tokens -> pieces 16, 16, 2
    "long2.txt": b"0123456789abcdefghijklmnopqrstuv",  # 32 bytes -> 33 tokens -> 16, 16 (a 1 is dropped)
}
BAD = {"bin.dat": b"\x00\x01\x02binary", "latin1.txt": "caf\u00e9".encode("latin-1"), "empty.txt": b""}


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for name, data in {**TEXTS, **BAD, ".hidden": b"secret"}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def _tokens(data: bytes) -> list[int]:
    return [BOS, *data]


def _cfg(source, **kw) -> CorpusConfig:
    return CorpusConfig(source=str(source), max_context=kw.pop("max_context", 16), **kw)


def test_split_keys_ids_lengths_stats_and_tokens(ray_cluster, text_dir):
    c = load_corpus(_cfg(text_dir, block_tokens=16))
    long_pieces = [f"long.txt#piece{k}" for k in range(3)] + [f"long2.txt#piece{k}" for k in range(2)]
    assert c.keys == ["_top.py", "a.txt", *long_pieces, "sub/b.py"]
    assert c.lengths.dtype == np.int32  # memory-mapped from the store's index (4 bytes a document)
    assert c.lengths.tolist() == [7, 13, 16, 16, 2, 16, 16, 14]
    st = c.stats
    assert (st["files"], st["records"], st["documents"], st["tokens"]) == (8, 8, 8, int(c.lengths.sum()))
    assert (st["skipped_binary"], st["skipped_empty"], st["skipped_hidden"]) == (2, 1, 1)
    assert (st["split_docs"], st["pieces_added"], st["dropped_short_pieces"], st["dropped_over_long"]) == (2, 5, 1, 0)
    assert st["examples"]["skipped_binary"] == ["bin.dat", "latin1.txt"]
    assert st["examples"]["skipped_empty"] == ["empty.txt"]
    assert st["examples"]["dropped_short_pieces"] == ["long2.txt#piece2"]
    skipped = st["skipped_binary"] + st["skipped_empty"] + st["skipped_no_text"] + st["dropped_over_long"]
    assert st["documents"] == st["records"] - skipped - st["split_docs"] + st["pieces_added"]
    assert c.tokenizer_name == "byte" and c.vocab_size == 257 and c.num_docs == 8
    toks = c.get_tokens(range(c.num_docs))
    by_key = dict(zip(c.keys, toks, strict=True))
    for name in ("_top.py", "a.txt", "sub/b.py"):
        assert by_key[name].dtype == np.int32 and by_key[name].tolist() == _tokens(TEXTS[name])
    assert np.concatenate([by_key[k] for k in long_pieces[:3]]).tolist() == _tokens(TEXTS["long.txt"])
    assert np.concatenate([by_key[k] for k in long_pieces[3:]]).tolist() == _tokens(TEXTS["long2.txt"])[:32]


def test_ids_are_deterministic_across_part_layouts(ray_cluster, text_dir, tmp_path):
    b = load_corpus(_cfg(text_dir, block_tokens=1 << 20))
    prepare_store(_cfg(text_dir, block_tokens=1), tmp_path / "store", unit_bytes=1)  # a block per file
    a = load_corpus(CorpusConfig(source=str(tmp_path / "store")))
    assert len(a.blocks) == 7 and len(b.blocks) == 1  # empty.txt joins the next file's block
    assert a.store == str(tmp_path / "store")
    assert a.keys == b.keys and np.array_equal(a.lengths, b.lengths)
    assert [t.tolist() for t in a.get_tokens(range(a.num_docs))] == [t.tolist() for t in b.get_tokens(range(8))]


def test_fetch_documents_on_a_worker_from_block_specs(ray_cluster, text_dir, tmp_path):
    ray = ray_cluster
    prepare_store(_cfg(text_dir), tmp_path / "store", unit_bytes=1)
    c = load_corpus(CorpusConfig(source=str(tmp_path / "store")))
    ids = [c.keys.index("sub/b.py"), c.keys.index("a.txt")]
    locs = c.locate(ids)
    assert all(isinstance(loc, DocRef) for loc in locs) and pickle.loads(pickle.dumps(locs)) == locs
    refs = c.block_specs(loc.block for loc in locs)
    assert set(refs) == {loc.block for loc in locs} and len(refs) < len(c.blocks)

    @ray.remote
    def worker(locations, specs):  # descriptors only: the worker reads the blocks itself
        assert all(isinstance(s, BlockSpec) for s in specs.values())
        return [t.tolist() for t in fetch_documents(open_blocks(specs), locations)]

    assert ray.get(worker.remote(locs, refs)) == [_tokens(TEXTS["sub/b.py"]), _tokens(TEXTS["a.txt"])]
    with pytest.raises(KeyError, match="block_specs"):
        fetch_documents({}, locs)
    with pytest.raises(IndexError, match="out of range"):
        c.locate([c.num_docs])


def test_over_long_drop_and_reject(ray_cluster, text_dir):
    c = load_corpus(_cfg(text_dir, over_long="drop"))
    assert c.keys == ["_top.py", "a.txt", "sub/b.py"]
    assert c.stats["dropped_over_long"] == 2 and c.stats["examples"]["dropped_over_long"] == ["long.txt", "long2.txt"]
    with pytest.raises(DataError, match=r"2 document\(s\) exceed max_context=16.*long.txt with 34 tokens.*'split'"):
        load_corpus(_cfg(text_dir, over_long="reject"))


def test_bad_files_error_names_them(ray_cluster, text_dir):
    with pytest.raises(DataError, match=r"2 document\(s\) are binary.*bin.dat, latin1.txt.*bad_files='skip'"):
        load_corpus(_cfg(text_dir, bad_files="error"))


def test_extensions_and_single_file(ray_cluster, text_dir):
    c = load_corpus(_cfg(text_dir, extensions=("py",)))
    assert c.keys == ["_top.py", "sub/b.py"] and c.stats["skipped_extension"] == 6
    one = load_corpus(_cfg(text_dir / "a.txt"))
    assert one.keys == ["a.txt"] and one.get_tokens([0])[0].tolist() == _tokens(TEXTS["a.txt"])


def test_jsonl_records_with_text_field(ray_cluster, tmp_path):
    lines = [{"text": "alpha", "id": 1}, {"text": ""}, {"id": 3}, {"text": "b\u00e9ta"}]
    body = "\n".join(json.dumps(r) for r in lines) + "\n"
    (tmp_path / "sub").mkdir()
    (tmp_path / "data.jsonl").write_text(body)
    (tmp_path / "sub" / "more.jsonl").write_text(json.dumps({"text": "gamma"}) + "\n")
    c = load_corpus(_cfg(tmp_path))
    assert c.stats["format"] == "jsonl"
    assert c.keys == ["data.jsonl:1", "data.jsonl:4", "sub/more.jsonl:1"]
    assert [t.tolist() for t in c.get_tokens(range(3))] == [
        _tokens(s.encode()) for s in ("alpha", "b\u00e9ta", "gamma")
    ]
    assert (c.stats["skipped_empty"], c.stats["skipped_no_text"], c.stats["records"]) == (1, 1, 5)
    assert c.stats["examples"]["skipped_no_text"] == ["data.jsonl:3"]
    with pytest.raises(DataError, match="no text"):
        load_corpus(_cfg(tmp_path, bad_files="error"))
    other = load_corpus(_cfg(tmp_path / "sub" / "more.jsonl", text_field="text"))
    assert other.keys == ["more.jsonl:1"]


def test_jsonl_record_numbers_survive_many_byte_ranges(ray_cluster, tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "big.jsonl").write_text("".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(400)))
    prepare_store(_cfg(tmp_path / "src", block_tokens=64), tmp_path / "store", unit_bytes=300)  # ~14 lines a range
    c = load_corpus(CorpusConfig(source=str(tmp_path / "store")))
    assert len(c.blocks) > 10 and c.keys == sorted(c.keys, key=lambda k: int(k.split(":")[1]))
    assert c.keys[0] == "big.jsonl:1" and c.keys[-1] == "big.jsonl:400"
    for doc_id, tokens in zip(range(0, 400, 37), c.get_tokens(range(0, 400, 37)), strict=True):
        assert tokens.tolist() == _tokens(f"record {doc_id}".encode())


def test_jsonl_missing_field_and_malformed(ray_cluster, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"content": "x", "id": 1}\n{"content": "y", "id": 2}\n')
    with pytest.raises(DataError, match=r"a.jsonl: no record has a 'text' field \(fields seen: content, id\)"):
        load_corpus(_cfg(tmp_path))
    assert load_corpus(_cfg(tmp_path, text_field="content")).keys == ["a.jsonl:1", "a.jsonl:2"]
    with pytest.raises(DataError, match="holds int64 values"):
        load_corpus(_cfg(tmp_path, text_field="id"))
    (tmp_path / "b.jsonl").write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(DataError, match=r"b.jsonl:2: malformed JSONL record \(line 2\): not valid JSON"):
        load_corpus(_cfg(tmp_path / "b.jsonl"))


def test_parquet_rows(ray_cluster, tmp_path):
    texts = ["first row", "", "third \u00fc", None, "x" * 25]
    pq.write_table(pa.table({"body": texts, "n": list(range(5))}), tmp_path / "t.parquet", row_group_size=2)
    c = load_corpus(_cfg(tmp_path / "t.parquet", text_field="body", max_context=64))
    assert c.stats["format"] == "parquet"
    assert c.keys == ["t.parquet:0", "t.parquet:2", "t.parquet:4"]
    assert c.get_tokens([1])[0].tolist() == _tokens("third \u00fc".encode())
    assert (c.stats["skipped_empty"], c.stats["skipped_no_text"]) == (1, 1)
    with pytest.raises(DataError, match=r"has no column 'text' \(columns: body, n\)"):
        load_corpus(_cfg(tmp_path))


def test_clear_errors_for_missing_empty_and_unusable_sources(ray_cluster, tmp_path, monkeypatch):
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(_cfg(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no \\(non-hidden\\) files"):
        load_corpus(_cfg(tmp_path / "empty"))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "x.bin").write_bytes(b"\x00\x00")
    (tmp_path / "bin" / "e.txt").write_bytes(b"")
    with pytest.raises(DataError, match="no documents left .* 2 read, 1 binary, 1 empty"):
        load_corpus(_cfg(tmp_path / "bin"))
    with pytest.raises(ValueError, match="over_long"):
        CorpusConfig(over_long="truncate")
    with pytest.raises(ValueError, match="min_tokens <= max_context"):
        CorpusConfig(max_context=1, min_tokens=2)
    monkeypatch.setattr(ray_cluster, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="ray.init"):
        load_corpus(_cfg(tmp_path))


# What Ray Data prints around an execution unless told not to (banners, progress, hints, stats, its DataContext).
RAY_DATA_NOISE = (
    "Starting execution of Dataset",
    "Execution plan of Dataset",
    "progress UI is available",
    "tqdm is not installed",
    "Progress bars disabled",
    "Progress will be logged",
    "Running Dataset",
    "execution finished",
    "Data Context for dataset",
    "Operator",
)


@pytest.fixture
def ray_data_console_at_debug(ray_cluster, capfd):
    """The `ray.data` logger at DEBUG (where Ray Data logs its DataContext and operator stats), and a DEBUG handler
    on it and on `ray` that writes to capfd's stderr. (Ray's own console handlers keep the stream they were created
    with, under pytest an earlier test's capture, so capfd alone would miss them.) Yields the `ray.data` logger."""
    import ray.data  # noqa: F401 - configures the `ray.data` logger

    loggers = [logging.getLogger("ray.data"), logging.getLogger("ray")]
    handler, level = logging.StreamHandler(sys.stderr), loggers[0].level
    handler.setLevel(logging.DEBUG)
    loggers[0].setLevel(logging.DEBUG)
    for lg in loggers:
        lg.addHandler(handler)
    yield loggers[0]
    for lg in loggers:
        lg.removeHandler(handler)
    loggers[0].setLevel(level)


def test_load_is_quiet_and_restores_ray_data_settings(ray_data_console_at_debug, text_dir, tmp_path, capfd):
    import ray.data

    data_log = ray_data_console_at_debug
    ctx = ray.data.DataContext.get_current()
    before = (ctx.enable_progress_bars, ctx.print_on_execution_start, ctx.execution_options.preserve_order)
    (tmp_path / "d.jsonl").write_text('{"text": "alpha"}\n{"text": "beta"}\n')
    pq.write_table(pa.table({"text": ["fine"] * 50}), tmp_path / "bad.parquet")
    body = bytearray((tmp_path / "bad.parquet").read_bytes())
    body[4:24] = b"\xff" * 20  # a corrupt page header: the schema (footer) reads, the data does not
    (tmp_path / "bad.parquet").write_bytes(bytes(body))
    capfd.readouterr()
    assert load_corpus(_cfg(text_dir)).num_docs == 8
    assert load_corpus(_cfg(tmp_path / "d.jsonl")).keys == ["d.jsonl:1", "d.jsonl:2"]
    out, err = capfd.readouterr()
    noisy = [line for line in (out + err).splitlines() if any(n.lower() in line.lower() for n in RAY_DATA_NOISE)]
    assert not noisy, "\n".join(noisy)
    assert data_log.level == logging.DEBUG and logging.getLogger("ray.data._internal.progress").level == 0
    with pytest.raises(DataError, match="could not read"):  # a failed read restores the settings too
        load_corpus(_cfg(tmp_path / "bad.parquet"))
    assert data_log.level == logging.DEBUG and ray.data.DataContext.get_current() is ctx
    assert (ctx.enable_progress_bars, ctx.print_on_execution_start, ctx.execution_options.preserve_order) == before


@pytest.mark.slow
def test_default_stdlib_corpus(ray_cluster):
    c = load_corpus(CorpusConfig())
    st = c.stats
    assert st["format"] == "text" and st["files"] == st["records"] > 500
    assert st["documents"] == c.num_docs > st["records"] and st["tokens"] > 5_000_000
    assert int(c.lengths.max()) <= 2048 and int(c.lengths.min()) >= 2
    assert c.keys == sorted(c.keys, key=lambda k: (k.split("#")[0], int(k.split("#piece")[1]) if "#" in k else 0))
    assert not any(k.startswith(("site-packages", "dist-packages")) for k in c.keys)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    expected = _tokens((stdlib / "os.py").read_bytes())
    pieces = [t.tolist() for t in c.get_tokens([i for i, k in enumerate(c.keys) if k.startswith("os.py#")])]
    assert sum(pieces, []) == expected[: sum(map(len, pieces))] and pieces[0][0] == BOS
