"""The prepared corpus store (flexorch.data.store): prepared once, reused while its fingerprints match, redone
where a block is missing or damaged, and read back exactly. In-process prepares (``parallelism=0``, no Ray) except
where a real prepare process is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from flexorch.config import CorpusConfig
from flexorch.data.corpus import load_corpus, open_store
from flexorch.data.errors import DataError
from flexorch.data.store import layout
from flexorch.data.store.prepare import prepare_store
from flexorch.data.tokenizer import ByteTokenizer
from tests.chat_helpers import write_jsonl

BOS = ByteTokenizer.BOS


def _jsonl(path: Path, n: int, width: int = 40) -> Path:
    rng = np.random.default_rng(n)
    lines = [json.dumps({"text": f"doc {i} " + "y" * int(rng.integers(1, width))}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def _events():
    seen: list[str] = []
    return seen, lambda ev: seen.append(ev.get("message", ""))


def test_a_store_reads_back_every_document_and_a_second_load_prepares_nothing(tmp_path):
    src = _jsonl(tmp_path / "d.jsonl", 500)
    cfg = CorpusConfig(source=str(src), max_context=16, cache=str(tmp_path / "cache"))
    seen, say = _events()
    a = load_corpus(cfg, say, parallelism=0)
    assert any("prepared the corpus" in m for m in seen)
    texts = [json.loads(line)["text"].encode() for line in src.read_text().splitlines()]
    whole = {}
    for key, toks in zip(a.keys, a.get_tokens(range(a.num_docs)), strict=True):
        whole.setdefault(key.split("#")[0], []).extend(toks.tolist())
    assert whole == {f"d.jsonl:{i + 1}": [BOS, *t][: len(whole[f"d.jsonl:{i + 1}"])] for i, t in enumerate(texts)}
    assert all(len(v) >= min(len(t) + 1, 16) for v, t in zip(whole.values(), texts, strict=True))
    manifest = json.loads((Path(a.store) / "manifest.json").read_text())
    assert manifest["dtype"] == "<u2" and manifest["documents"] == a.num_docs  # byte ids fit in uint16
    seen2, say2 = _events()
    b = load_corpus(cfg, say2, parallelism=0)
    assert not any("prepar" in m for m in seen2) and any("opened the corpus store" in m for m in seen2)
    assert b.store == a.store and b.keys == a.keys and np.array_equal(b.lengths, a.lengths)
    assert isinstance(b.lengths, np.memmap)  # the index is mapped, not read


def test_byte_ranges_give_the_same_corpus_as_one_block(tmp_path):
    src = _jsonl(tmp_path / "d.jsonl", 300)
    cfg = CorpusConfig(source=str(src), max_context=12)
    prepare_store(cfg, tmp_path / "one", parallelism=0, unit_bytes=1 << 40)
    prepare_store(cfg, tmp_path / "many", parallelism=0, unit_bytes=700)
    one, many = open_store(tmp_path / "one"), open_store(tmp_path / "many")
    assert len(one.blocks) == 1 and len(many.blocks) > 10
    assert one.keys == many.keys and np.array_equal(one.lengths, many.lengths)
    for x, y in zip(one.get_stored(range(one.num_docs)), many.get_stored(range(many.num_docs)), strict=True):
        assert np.array_equal(x, y)


def test_a_changed_source_or_setting_is_named_and_prepared_again(tmp_path):
    src = _jsonl(tmp_path / "d.jsonl", 50)
    cache = str(tmp_path / "cache")
    first = load_corpus(CorpusConfig(source=str(src), cache=cache), parallelism=0)
    with src.open("a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    seen, say = _events()
    again = load_corpus(CorpusConfig(source=str(src), cache=cache), say, parallelism=0)
    assert again.store == first.store and again.num_docs == 51 and again.keys[-1] == "d.jsonl:51"
    assert any("out of date" in m and "d.jsonl (size" in m for m in seen), seen
    seen, say = _events()
    other = load_corpus(CorpusConfig(source=str(src), cache=cache, max_context=8), say, parallelism=0)
    assert other.store != first.store and max(other.lengths) <= 8
    assert any("max_context 2048 -> 8" in m for m in seen), seen


def test_a_truncated_or_corrupted_part_is_named_and_prepared_again(tmp_path):
    src = _jsonl(tmp_path / "d.jsonl", 400)
    cfg = CorpusConfig(source=str(src), max_context=64)
    prepare_store(cfg, tmp_path / "s", parallelism=0, unit_bytes=2000)
    part = tmp_path / "s" / "parts" / "part-00001.bin"
    data = bytearray(part.read_bytes())
    data[3] ^= 0xFF  # one flipped byte: same size, caught by the digest of the MiB it lies in
    part.write_bytes(bytes(data))
    c = open_store(tmp_path / "s")
    ids = [i for i in range(c.num_docs) if int(c.doc_blocks[i]) == 1][:1]
    with pytest.raises(DataError, match=r"part-00001\.bin is corrupted"):
        c.get_stored(ids)
    part.write_bytes(bytes(data[:-10]))  # truncated
    with pytest.raises(DataError, match=r"part-00001\.bin has .* bytes, the manifest says"):
        open_store(tmp_path / "s")
    with pytest.raises(DataError, match="damaged"):
        load_corpus(CorpusConfig(source=str(tmp_path / "s")))
    part.write_bytes(bytes(data))  # the same size again, one byte flipped: only a full check finds it
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "s" / "parts").glob("*.bin")}
    seen, say = _events()
    prepare_store(cfg, tmp_path / "s", say, parallelism=0, unit_bytes=2000, verify=True)  # `flexorch prepare`
    assert any("block 1 of" in m and "sha256 differs" in m for m in seen), seen
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "s" / "parts").glob("*.bin")}
    assert [n for n in before if before[n] != after[n]] == ["part-00001.bin"]
    prepare_store(cfg, tmp_path / "fresh", parallelism=0, unit_bytes=2000)
    fixed, fresh = open_store(tmp_path / "s"), open_store(tmp_path / "fresh")
    assert all(
        np.array_equal(x, y)
        for x, y in zip(fixed.get_stored(range(fixed.num_docs)), fresh.get_stored(range(fresh.num_docs)), strict=True)
    )


def test_a_damaged_part_in_the_cache_is_redone_by_the_next_load(tmp_path):
    src = _jsonl(tmp_path / "d.jsonl", 200)
    cfg = CorpusConfig(source=str(src), cache=str(tmp_path / "cache"))
    c = load_corpus(cfg, parallelism=0)
    part = Path(c.blocks[0].path)
    part.write_bytes(part.read_bytes()[:100])
    seen, say = _events()
    again = load_corpus(cfg, say, parallelism=0)
    assert any("damaged" in m for m in seen) and again.get_stored([0])[0].tolist() == c.get_stored([0])[0].tolist()


def test_masked_records_keep_their_mask_in_a_signed_store(tmp_path):
    rows = [{"prompt": f"q{i}?", "completion": f" a{i}."} for i in range(20)]
    src = write_jsonl(tmp_path / "pc.jsonl", rows)
    cfg = CorpusConfig(source=str(src))
    prepare_store(cfg, tmp_path / "s", parallelism=0)
    c = open_store(tmp_path / "s")
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["dtype"] == "<i2"
    stored = c.get_stored([3])[0]
    assert (stored < 0).any() and (stored >= 0).any()  # the prompt as ~id, the completion as ids
    assert int(c.targets[3]) == int((stored[1:] >= 0).sum())


def test_a_store_given_as_source_must_fit_the_run(tmp_path):
    src = _jsonl(tmp_path / "d.jsonl", 50)
    prepare_store(CorpusConfig(source=str(src), max_context=4096), tmp_path / "s", parallelism=0)
    with pytest.raises(DataError, match="over this run's max_context=8"):
        load_corpus(CorpusConfig(source=str(tmp_path / "s"), max_context=8))
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    with pytest.raises(DataError, match="was tokenized with 'byte'"):
        load_corpus(CorpusConfig(source=str(tmp_path / "s"), tokenizer=f"hf:{tmp_path / 'tok'}"))
    (tmp_path / "half").mkdir()
    layout.atomic_write_json(tmp_path / "half" / "plan.json", {"units": []})
    with pytest.raises(DataError, match="did not finish"):
        load_corpus(CorpusConfig(source=str(tmp_path / "half")))


@pytest.mark.slow
def test_a_killed_prepare_is_finished_by_the_next_one_redoing_only_the_rest(tmp_path):
    src = _jsonl(tmp_path / "d.jsonl", 60_000, width=200)  # ~7 MB: over 100 blocks of 64 KiB
    out = tmp_path / "s"
    cmd = [sys.executable, "-m", "flexorch", "prepare", str(src), str(out), "--parallelism", "0", "--part-mb"]
    shm_before = set(os.listdir("/dev/shm"))  # what other runs left there is not this prepare's
    proc = subprocess.Popen([*cmd, "0.0625"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(list((out / "parts").glob("*.done.json"))) < 5 and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = {p.name: p.stat().st_mtime_ns for p in (out / "parts").glob("*.done.json")}
    units = len(json.loads((out / "plan.json").read_text())["units"])
    assert units > 100 and 5 <= len(done) < units and not (out / "manifest.json").exists()
    assert not [p for p in set(os.listdir("/dev/shm")) - shm_before if "flexorch" in p]  # the killed prepare left none
    run = subprocess.run([*cmd, "0.0625"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"{len(done)} of {units} blocks already done" in run.stdout
    assert all((out / "parts" / n).stat().st_mtime_ns == t for n, t in done.items())  # not redone
    c = open_store(out)
    assert c.num_docs == 60_000 and c.keys[-1] == "d.jsonl:60000"
    assert c.get_tokens([59_999])[0].tolist() == [BOS, *json.loads(src.read_text().splitlines()[-1])["text"].encode()]


def test_a_new_run_with_a_bpe_reuses_the_tokenizer_and_the_store(tmp_path):
    pytest.importorskip("tokenizers")
    from flexorch.data.bpe import prepare_tokenizer

    src = _jsonl(tmp_path / "d.jsonl", 300)
    cfg = CorpusConfig(source=str(src), tokenizer="bpe:300", cache=str(tmp_path / "cache"))
    first = load_corpus(prepare_tokenizer(cfg, tmp_path / "run1"), parallelism=0)
    again = prepare_tokenizer(cfg, tmp_path / "run2")  # another run directory: copied from the cache, not trained
    assert again.tokenizer == f"hf:{tmp_path / 'run2' / 'tokenizer'}"
    seen, say = _events()
    second = load_corpus(again, say, parallelism=0)
    assert [m for m in seen if "prepar" in m] == [] and second.store == first.store
    assert (
        second.tokenizer_name == again.tokenizer
        and second.get_stored([7])[0].tolist() == first.get_stored([7])[0].tolist()
    )
