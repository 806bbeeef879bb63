"""Bad input fails fast with a clear message: check_source (no Ray), malformed JSONL records, empty sources and
zero-length documents in `flexorch plan --lengths` and in a loaded corpus."""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flexorch.cli.main import main
from flexorch.config.data import CorpusConfig
from flexorch.data.errors import DataError
from flexorch.data.source_check import check_source

SKIP_HINT = r'\[data\] on_bad_record = "skip"'


def _jsonl(path, lines):
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def test_on_bad_record_is_validated():
    assert CorpusConfig().on_bad_record == "error"
    assert CorpusConfig(on_bad_record="skip").on_bad_record == "skip"
    with pytest.raises(ValueError, match="on_bad_record must be 'error' .* or 'skip'.*got 'warn'"):
        CorpusConfig(on_bad_record="warn")


def test_check_source_refuses_missing_and_empty_sources(tmp_path):
    with pytest.raises(DataError, match="nope does not exist"):
        check_source(CorpusConfig(source=str(tmp_path / "nope")))
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty.jsonl is empty \(0 bytes\)"):
        check_source(CorpusConfig(source=str(tmp_path / "empty.jsonl")))
    (tmp_path / "dir").mkdir()
    with pytest.raises(DataError, match=r"has no \(non-hidden\) files"):
        check_source(CorpusConfig(source=str(tmp_path / "dir")))
    (tmp_path / "blank.jsonl").write_text("\n  \n\n")
    with pytest.raises(DataError, match="no documents in .*blank.jsonl"):
        check_source(CorpusConfig(source=str(tmp_path / "blank.jsonl")))


def test_check_source_text_dirs(tmp_path):
    d = tmp_path / "texts"
    d.mkdir()
    (d / "a_empty.txt").write_bytes(b"")
    (d / "b_binary.dat").write_bytes(b"\x00\x01\x02")
    (d / ".hidden.txt").write_text("hidden text")
    with pytest.raises(DataError, match="no documents in .*none of its 2 text file"):
        check_source(CorpusConfig(source=str(d)))
    (d / "c_good.txt").write_text("def f():\n    return 1\n")
    check_source(CorpusConfig(source=str(d)))


def test_check_source_jsonl_malformed_line_before_first_record(tmp_path):
    f = _jsonl(tmp_path / "data.jsonl", ['{"text": "unterminated', {"text": "fine"}])
    with pytest.raises(
        DataError, match=rf"data.jsonl:1: malformed JSONL record \(line 1\): not valid JSON .*{SKIP_HINT}"
    ):
        check_source(CorpusConfig(source=str(f)))
    check_source(CorpusConfig(source=str(f), on_bad_record="skip"))
    g = _jsonl(tmp_path / "g.jsonl", ["", {"text": ""}, "[1, 2]", {"text": "ok"}])
    with pytest.raises(DataError, match=r"g.jsonl:3: malformed JSONL record \(line 3\): a JSON list, not an object"):
        check_source(CorpusConfig(source=str(g)))
    h = _jsonl(tmp_path / "h.jsonl", [{"text": 7}, {"text": "ok"}])
    with pytest.raises(DataError, match="h.jsonl:1: .*field 'text' holds a JSON int, not a string"):
        check_source(CorpusConfig(source=str(h)))
    # stops at the first good record: a malformed line after it is the load's business
    _jsonl(tmp_path / "late.jsonl", [{"text": "ok"}, "{broken"])
    check_source(CorpusConfig(source=str(tmp_path / "late.jsonl")))
    wrong = _jsonl(tmp_path / "wrong.jsonl", [{"content": "x"}, {"content": "y"}])
    with pytest.raises(DataError, match=r"no record has a 'text' field \(fields seen: content\)"):
        check_source(CorpusConfig(source=str(wrong)))
    check_source(CorpusConfig(source=str(wrong), text_field="content"))


def test_check_source_parquet(tmp_path):
    pq.write_table(pa.table({"body": ["a doc", "another"]}), tmp_path / "t.parquet")
    check_source(CorpusConfig(source=str(tmp_path / "t.parquet"), text_field="body"))
    with pytest.raises(DataError, match=r"has no column 'text' \(columns: body\)"):
        check_source(CorpusConfig(source=str(tmp_path / "t.parquet")))
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "e.parquet")
    with pytest.raises(DataError, match="e.parquet is empty: .*no rows"):
        check_source(CorpusConfig(source=str(tmp_path / "e.parquet")))


def test_check_source_default_corpus_and_large_files_are_fast(tmp_path):
    t0 = time.perf_counter()
    check_source(CorpusConfig())  # the stdlib's .py files
    big = tmp_path / "big.jsonl"
    with big.open("w") as f:
        f.write(json.dumps({"text": "first"}) + "\n")
        f.writelines(json.dumps({"text": "x" * 1000}) + "\n" for _ in range(20_000))
    check_source(CorpusConfig(source=str(big)))
    assert time.perf_counter() - t0 < 60  # a hang or a whole read of every file, not speed


def _plan(argv, capsys):
    code = main(argv)
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_plan_lengths_drops_and_counts_zero_lengths(tmp_path, capsys):
    f = tmp_path / "lengths.txt"
    f.write_text("100\n0\n200\n300\n0\n400\n")
    args = ["plan", "--lengths", str(f), "--workers", "4", "--batch", "2", "--steps", "1"]
    code, out, _ = _plan(args, capsys)
    assert code == 0
    assert "dropped 2 zero-length document(s)" in out and "kept 4, dropped 2 empty" in out
    code, out, err = _plan([*args, "--json"], capsys)  # stdout stays JSON; the count goes to stderr
    assert code == 0 and "dropped 2 zero-length document(s)" in err
    assert all(json.loads(line)["step"] == 0 for line in out.splitlines())
    f.write_text("100\n0\n-5\n300\n")
    code, _, err = _plan(args, capsys)
    assert code == 2 and "lengths.txt:3: a length cannot be negative, got -5 (line 3)" in err
    f.write_text("100\n1.5\n")
    code, _, err = _plan(args, capsys)
    assert code == 2 and "lengths.txt:2: expected one integer length per line" in err


@pytest.mark.slow
def test_load_corpus_malformed_middle_line_error_and_skip(ray_cluster, tmp_path):
    from flexorch.data.corpus import load_corpus

    lines = [{"text": "alpha"}, {"text": "beta"}, '{"text": "gam', {"text": ""}, "", {"text": "delta"}]
    f = _jsonl(tmp_path / "data.jsonl", lines)
    t0 = time.perf_counter()
    with pytest.raises(
        DataError, match=rf"data.jsonl:3: malformed JSONL record \(line 3\): not valid JSON .*{SKIP_HINT}"
    ):
        load_corpus(CorpusConfig(source=str(f)))
    c = load_corpus(CorpusConfig(source=str(f), on_bad_record="skip"))
    # keys are record numbers (blank lines are not records): the bad one is record 3, the empty text record 4
    assert c.keys == ["data.jsonl:1", "data.jsonl:2", "data.jsonl:5"]
    assert [bytes(t[1:].astype("uint8")).decode() for t in c.get_tokens(range(3))] == ["alpha", "beta", "delta"]
    st = c.stats
    assert (st["bad_records"], st["skipped_empty"], st["records"], st["documents"]) == (1, 1, 5, 3)
    assert st["examples"]["bad_records"] == ["data.jsonl:3"] and st["examples"]["skipped_empty"] == ["data.jsonl:4"]
    assert time.perf_counter() - t0 < 60


@pytest.mark.slow
def test_load_corpus_empty_sources_are_clear_errors(ray_cluster, tmp_path):
    from flexorch.data.corpus import load_corpus

    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(DataError, match=r"empty.jsonl is empty \(0 bytes\)"):
        load_corpus(CorpusConfig(source=str(tmp_path / "empty.jsonl")))
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.jsonl").write_bytes(b"")
    (d / "b.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"is empty: its 2 file\(s\) hold no records"):
        load_corpus(CorpusConfig(source=str(d)))
    _jsonl(d / "c.jsonl", [{"text": ""}, [1], {"text": "ok"}])
    c = load_corpus(CorpusConfig(source=str(d), on_bad_record="skip"))
    assert c.keys == ["c.jsonl:3"] and (c.stats["skipped_empty"], c.stats["bad_records"]) == (1, 1)
