"""Chat, prompt/completion, tokenized and Hugging Face ``datasets`` sources loaded through Ray Data: every record
becomes a document whose loss targets are the ones its kind says, malformed records are named (file and line or
row) or skipped and counted, over-long conversations split only where an answer ends."""

from __future__ import annotations

import numpy as np
import pytest

from flexorch.config import CorpusConfig
from flexorch.data.corpus import load_corpus
from flexorch.data.errors import DataError
from flexorch.data.record_kinds import encode_record
from flexorch.data.targets import count_targets
from flexorch.data.tokenizer import ByteTokenizer
from tests.chat_helpers import (
    chat_tokenizer_dir,
    conversations,
    prompt_completions,
    tokenized_rows,
    write_jsonl,
    write_parquet,
)

BYTE = ByteTokenizer()


@pytest.fixture(scope="module", autouse=True)
def _ray():
    from tests.ray_env import shared_ray

    shared_ray()


def _expected(kind, rows, tok, cfg):
    return [encode_record(kind, r, tok, cfg).tolist() for r in rows]


def _check(corpus, kind, rows, tok, cfg, keys):
    assert corpus.stats["records_kind"] == kind and corpus.keys == keys
    got = [t.tolist() for t in corpus.get_stored(range(corpus.num_docs))]
    assert got == _expected(kind, rows, tok, cfg)
    assert corpus.targets.tolist() == [count_targets(np.asarray(g)) for g in got]
    assert [loc.predicted for loc in corpus.locate(range(corpus.num_docs))] == corpus.targets.tolist()
    assert corpus.stats["targets"] == int(corpus.targets.sum()) < corpus.stats["tokens"] - corpus.num_docs


def test_a_chat_jsonl_file_is_sniffed_and_trains_on_its_answers(tmp_path):
    rows = conversations()
    path = write_jsonl(tmp_path / "chat.jsonl", [{**r, "id": i} for i, r in enumerate(rows)])
    cfg = CorpusConfig(source=str(path), max_context=4096)
    c = load_corpus(cfg)
    _check(c, "chat", rows, BYTE, cfg, [f"chat.jsonl:{i + 1}" for i in range(len(rows))])


def test_chat_with_the_tokenizers_own_template_and_prompt_completion_pairs(tmp_path):
    pytest.importorskip("transformers")
    from flexorch.data.tokenizer import get_tokenizer

    tok_dir = chat_tokenizer_dir(tmp_path / "tok")
    tok = get_tokenizer(f"hf:{tok_dir}")
    rows = conversations()
    cfg = CorpusConfig(source=str(write_jsonl(tmp_path / "c" / "a.jsonl", rows)), tokenizer=f"hf:{tok_dir}")
    _check(load_corpus(cfg), "chat", rows, tok, cfg, [f"a.jsonl:{i + 1}" for i in range(len(rows))])
    pairs = prompt_completions()
    cfg = CorpusConfig(source=str(write_jsonl(tmp_path / "p" / "pc.jsonl", pairs)), tokenizer=f"hf:{tok_dir}")
    _check(load_corpus(cfg), "prompt_completion", pairs, tok, cfg, [f"pc.jsonl:{i + 1}" for i in range(len(pairs))])


def test_tokenized_parquet_needs_no_tokenizer_and_sizes_the_vocabulary_by_its_ids(tmp_path):
    rows = tokenized_rows()
    cfg = CorpusConfig(source=str(write_parquet(tmp_path / "tok.parquet", rows)), max_context=4096)
    c = load_corpus(cfg)
    _check(c, "tokenized", rows, None, cfg, [f"tok.parquet:{i}" for i in range(len(rows))])
    assert c.tokenizer_name == "pre-tokenized"
    assert c.vocab_size == max(max(r["input_ids"]) for r in rows) + 1


def test_a_datasets_save_to_disk_directory_and_a_split_of_a_dataset_dict(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = conversations()
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    cfg = CorpusConfig(source=str(tmp_path / "ds"))
    c = load_corpus(cfg)
    assert c.stats["format"] == "hf_dataset"
    _check(c, "chat", rows, BYTE, cfg, [f"data-00000-of-00001.arrow:{i}" for i in range(len(rows))])
    pairs = prompt_completions()
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(pairs), "test": datasets.Dataset.from_list(pairs[:2])}
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    cfg = CorpusConfig(source=str(tmp_path / "dd"), split="test")
    _check(
        load_corpus(cfg),
        "prompt_completion",
        pairs[:2],
        BYTE,
        cfg,
        ["data-00000-of-00001.arrow:0", "data-00000-of-00001.arrow:1"],
    )
    with pytest.raises(DataError, match="DatasetDict with splits train, test; set \\[data\\] split"):
        load_corpus(CorpusConfig(source=str(tmp_path / "dd"), split="validation"))


def test_malformed_records_are_named_or_skipped_and_counted(tmp_path):
    rows = conversations()[:4]
    bad = [
        *rows[:2],
        {"messages": [{"role": "user", "content": "no answer here"}]},
        {"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"messages": "not a list"},
        *rows[2:],
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", bad)
    with pytest.raises(DataError, match=r"bad.jsonl:3: chat record 3 does not fit: no assistant turn.*on_bad_record"):
        load_corpus(CorpusConfig(source=str(path)))
    c = load_corpus(CorpusConfig(source=str(path), on_bad_record="skip"))
    assert c.num_docs == 4 and c.stats["bad_records"] == 3
    reasons = c.stats["bad_record_reasons"]
    assert [r.split(":")[1] for r in reasons] == ["3", "4", "5"]
    assert "no assistant turn" in reasons[0] and "'narrator'" in reasons[1] and "messages must be" in reasons[2]
    tok = tokenized_rows()
    tok[2] = {"input_ids": [1, 2, 3], "labels": [1, 2]}
    with pytest.raises(DataError, match=r"t.parquet:2: tokenized record 2 does not fit: 'labels' has 2 entries"):
        load_corpus(CorpusConfig(source=str(write_parquet(tmp_path / "t.parquet", tok))))
    with pytest.raises(DataError, match="no record has a 'messages' field .*set messages_field"):
        load_corpus(CorpusConfig(source=str(write_jsonl(tmp_path / "x" / "t.jsonl", [{"text": "a"}])), records="chat"))


def test_an_over_long_conversation_is_split_between_exchanges_or_dropped_and_counted(tmp_path):
    rows = conversations()
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    whole = [len(x) for x in _expected("chat", rows, BYTE, CorpusConfig())]
    longest = int(np.argmax(whole))
    cfg = CorpusConfig(source=str(path), max_context=400)
    c = load_corpus(cfg)
    pieces = [k for k in c.keys if k.startswith(f"chat.jsonl:{longest + 1}#piece")]
    assert len(pieces) > 1 and c.stats["split_docs"] == 1 and int(c.lengths.max()) <= 400
    joined = np.concatenate(c.get_stored([c.keys.index(k) for k in pieces]))
    assert joined.tolist() == _expected("chat", [rows[longest]], BYTE, cfg)[0]
    text = BYTE.decode(c.get_tokens([c.keys.index(pieces[1])])[0]).decode()
    assert text.startswith("<|im_start|>user\n")
    tight = load_corpus(CorpusConfig(source=str(path), max_context=150, on_bad_record="skip"))
    assert tight.stats["dropped_over_long"] >= 1 and int(tight.lengths.max()) <= 150


def test_an_over_long_record_without_a_mask_is_cut_like_text(tmp_path):
    rows = [{"input_ids": list(range(1, 301))}, {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}]
    c = load_corpus(CorpusConfig(source=str(write_parquet(tmp_path / "t.parquet", rows)), max_context=128))
    assert c.keys[:3] == ["t.parquet:0#piece0", "t.parquet:0#piece1", "t.parquet:0#piece2"]
    assert np.concatenate(c.get_stored(range(3))).tolist() == list(range(1, 301))  # every token a target
    assert c.stats["split_docs"] == 1 and c.stats["dropped_over_long"] == 0
