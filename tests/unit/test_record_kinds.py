"""Chat, prompt/completion and tokenized records -> stored tokens with their loss targets, and the labels every
SP shard computes from them. Fast: no Ray, no process group."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flexorch.config import CorpusConfig
from flexorch.data.chat import BadRecord, chat_tokens
from flexorch.data.record_kinds import encode_record, exchange_pieces, sniff_kind
from flexorch.data.targets import count_targets, encode_targets, hf_labels, token_ids
from flexorch.data.tokenizer import ByteTokenizer
from flexorch.workers.attention.sharding import shard
from flexorch.workers.model import IGNORE_INDEX, next_token_labels, stored_token_ids
from flexorch.workers.step_exec import micro_batch_inputs
from tests.chat_helpers import CHATML, DROPS_ROLES, chat_tokenizer_dir, conversations

BYTE = ByteTokenizer()
CFG = CorpusConfig()
CONVO = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "content": "6, of course"},
]


def _targets_text(tok, ids, flags) -> list[str]:
    """The target runs of a document, each decoded."""
    runs, cur = [], []
    for i, f in zip(ids, flags, strict=True):
        if f:
            cur.append(int(i))
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    if isinstance(tok, ByteTokenizer):
        return [bytes(r).decode() for r in runs]
    return [tok._tok.decode(r) for r in runs]


def test_the_builtin_template_trains_on_the_answers_and_their_end_markers_only():
    ids, flags = chat_tokens(CONVO, BYTE)
    assert ids[0] == BYTE.BOS and not flags[0]
    assert _targets_text(BYTE, ids, flags) == ["4<|im_end|>\n", "6, of course<|im_end|>\n"]
    text = BYTE.decode(ids).decode()
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n")
    every = encode_record("chat", {"messages": CONVO}, BYTE, CorpusConfig(loss_on="all"))
    assert (every >= 0).all() and token_ids(every).tolist() == ids.tolist()


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    pytest.importorskip("transformers")
    from flexorch.data.tokenizer import HFTokenizer

    return HFTokenizer(str(chat_tokenizer_dir(tmp_path_factory.mktemp("chatml"), CHATML)))


@pytest.fixture(scope="module")
def llama2(tmp_path_factory):
    pytest.importorskip("transformers")
    from flexorch.data.tokenizer import HFTokenizer

    return HFTokenizer(str(chat_tokenizer_dir(tmp_path_factory.mktemp("llama2"), DROPS_ROLES)))


def test_the_tokenizers_own_template_marks_exactly_its_answer_turns(chatml):
    ids, flags = chat_tokens(CONVO, chatml)
    # the whole conversation is what Transformers renders and tokenizes, answers split off without changing a token
    whole = chatml._tok.apply_chat_template(CONVO, tokenize=True, add_generation_prompt=False)
    whole = whole["input_ids"] if isinstance(whole, dict) or hasattr(whole, "keys") else whole
    assert ids.tolist() == [chatml.bos_id, *whole]
    assert _targets_text(chatml, ids, flags) == ["4<|im_end|>\n", "6, of course<|im_end|>\n"]


def test_a_template_that_writes_bos_itself_gets_no_second_one(llama2):
    ids, flags = chat_tokens(CONVO[1:], llama2)
    assert ids[0] == llama2.bos_id and ids[1] != llama2.bos_id
    assert [t.strip() for t in _targets_text(llama2, ids, flags)] == ["4</s>", "6, of course</s>"]


def test_roles_the_template_refuses_or_drops_and_conversations_without_an_answer_are_bad_records(chatml, llama2):
    with pytest.raises(BadRecord, match="refused it.*unknown role tool"):
        chat_tokens([{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}], chatml)
    with pytest.raises(BadRecord, match="message 0 .role 'system'. is not in what the chat template renders"):
        chat_tokens(CONVO, llama2)  # this template drops the system turn without a word
    with pytest.raises(BadRecord, match="no assistant turn"):
        chat_tokens([{"role": "user", "content": "hello?"}], chatml)
    with pytest.raises(BadRecord, match="not one the built-in chat template knows"):
        chat_tokens([{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}], BYTE)
    for bad in (None, [], "hi", [{"role": "user"}], [{"role": 1, "content": "x"}]):
        with pytest.raises(BadRecord, match="messages must be|message 0 must be"):
            chat_tokens(bad, BYTE)


def test_prompt_completion_trains_on_the_completion_and_its_eos(chatml):
    rec = {"prompt": "Q: 2+2? A:", "completion": " 4"}
    stored = encode_record("prompt_completion", rec, chatml, CFG)
    ids = token_ids(stored)
    assert ids[0] == chatml.bos_id and ids[-1] == chatml.eos_id
    assert chatml._tok.decode(ids[stored >= 0]) == " 4</s>"
    assert count_targets(stored) == len(chatml.encode_text(" 4")) + 1
    byte = encode_record("prompt_completion", rec, BYTE, CFG)  # no EOS in the byte tokenizer
    assert bytes(byte[byte >= 0].astype(np.uint8)).decode() == " 4"
    for bad, why in (({"prompt": "q", "completion": ""}, "is empty"), ({"prompt": 3, "completion": "a"}, "string")):
        with pytest.raises(BadRecord, match=why):
            encode_record("prompt_completion", bad, BYTE, CFG)


def test_tokenized_labels_and_loss_masks_become_the_same_targets():
    ids = [5, 6, 7, 8, 9]
    by_labels = encode_record("tokenized", {"input_ids": ids, "labels": [-100, -100, 7, 8, 9]}, None, CFG)
    by_mask = encode_record("tokenized", {"input_ids": ids, "loss_mask": [0, 0, 1, 1, 1]}, None, CFG)
    plain = encode_record("tokenized", {"input_ids": ids}, None, CFG)
    assert by_labels.tolist() == by_mask.tolist() == [~5, ~6, 7, 8, 9]
    assert plain.tolist() == ids and count_targets(plain) == 4
    ids_back, labels = hf_labels(by_labels)
    assert ids_back.tolist() == ids and labels.tolist() == [-100, -100, 7, 8, 9]


@pytest.mark.parametrize(
    "rec,why",
    [
        ({"input_ids": [1, 2, 3], "labels": [1, 2]}, "'labels' has 2 entries, 'input_ids' has 3"),
        ({"input_ids": [1, 2, 3], "labels": [1, 5, 3]}, "a label must be its input id or -100"),
        ({"input_ids": [1, 2, 3], "loss_mask": [1, 2, 0]}, "only 0 and 1"),
        ({"input_ids": [1, 2, 3], "labels": [-100] * 3}, "no token carries loss"),
        ({"input_ids": [1, -2, 3]}, "holds id -2"),
        ({"input_ids": "abc"}, "must be a list of integers"),
        ({"input_ids": [[1, 2], [3, 4]]}, "flat list"),
        ({"input_ids": [1, 2], "labels": [1, 2], "loss_mask": [1, 1]}, "keep one"),
    ],
)
def test_malformed_tokenized_records_say_what_is_wrong(rec, why):
    with pytest.raises(BadRecord, match=why):
        encode_record("tokenized", rec, None, CFG)


def test_kinds_are_sniffed_from_the_fields():
    assert sniff_kind(["messages", "id"], CFG) == "chat"
    assert sniff_kind(["prompt", "completion"], CFG) == "prompt_completion"
    assert sniff_kind(["input_ids", "labels"], CFG) == "tokenized"
    assert sniff_kind(["text"], CFG) == "text" and sniff_kind(["prompt"], CFG) == "text"
    assert sniff_kind(["conv"], CorpusConfig(messages_field="conv")) == "chat"
    assert CorpusConfig(format="chat").records == "chat"
    with pytest.raises(ValueError, match="disagree"):
        CorpusConfig(format="chat", records="tokenized")
    with pytest.raises(ValueError, match="loss_on"):
        CorpusConfig(loss_on="prompts")


def test_an_over_long_conversation_splits_only_where_an_answer_ends():
    long = conversations()[4]["messages"]
    stored = encode_record("chat", {"messages": long}, BYTE, CFG)
    pieces, dropped = exchange_pieces(stored, 400)
    assert dropped == 0 and len(pieces) > 1
    assert np.concatenate(pieces).tolist() == stored.tolist()  # nothing lost, nothing repeated
    assert sum(count_targets(p) for p in pieces) == count_targets(stored)
    for p in pieces:
        assert len(p) <= 400
        text = BYTE.decode(token_ids(p)).decode()
        assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_end|>\n")
        # every answer in the piece follows its own question inside the piece
        assert text.count("<|im_start|>user") == text.count("<|im_start|>assistant")
    assert exchange_pieces(stored, 100) is None  # one exchange alone is longer: no split keeps it whole
    trailing = encode_targets(np.arange(12), [False] * 3 + [True] * 3 + [False] * 6)
    kept, dropped = exchange_pieces(trailing, 6)
    assert [p.tolist() for p in kept] == [trailing[:6].tolist()] and dropped == 1  # a question with no answer


def test_labels_mask_the_non_targets_and_every_shard_keeps_exactly_its_tokens_labels():
    docs = [encode_record("chat", r, BYTE, CFG) for r in conversations()[:3]]
    stored = torch.from_numpy(np.concatenate(docs).astype(np.int64))
    cu = np.cumsum([0] + [len(d) for d in docs]).tolist()
    labels = next_token_labels(stored, torch.tensor(cu))
    ids = stored_token_ids(stored)
    assert (ids >= 0).all()
    expected = np.full(len(ids), IGNORE_INDEX)
    for d, a in zip(docs, cu, strict=False):
        _, lab = hf_labels(d)  # Transformers' convention: labels[i] = ids[i] or -100, shifted by the model
        expected[a : a + len(d) - 1] = lab[1:]
    assert labels.tolist() == expected.tolist()
    assert int((labels != IGNORE_INDEX).sum()) == sum(count_targets(d) for d in docs)
    for kind in ("ulysses", "ring"):
        for degree in (1, 2, 4):
            got = 0
            for r in range(degree):
                sid, _, lab, layout = micro_batch_inputs(stored, cu, r, degree, kind)
                assert sid.tolist() == shard(ids, layout).tolist()
                real = layout.loss_mask  # padding predicts nothing
                assert lab[real].tolist() == shard(labels, layout)[real].tolist()
                got += int((lab != IGNORE_INDEX).sum())
            assert got == int((labels != IGNORE_INDEX).sum()), (kind, degree)


def test_the_pre_flight_check_knows_chat_tokenized_and_datasets_sources(tmp_path):
    from flexorch.data.errors import DataError
    from flexorch.data.source_check import check_source
    from tests.chat_helpers import tokenized_rows, write_jsonl, write_parquet

    check_source(CorpusConfig(source=str(write_jsonl(tmp_path / "c.jsonl", conversations()))))
    check_source(CorpusConfig(source=str(write_parquet(tmp_path / "t.parquet", tokenized_rows()))))
    with pytest.raises(DataError, match="no record has a 'messages' field .*records = 'chat'"):
        check_source(CorpusConfig(source=str(write_jsonl(tmp_path / "x" / "t.jsonl", [{"text": "a"}])), records="chat"))
    no_ids = write_parquet(tmp_path / "y" / "u.parquet", [{"ids": [1]}])
    with pytest.raises(DataError, match="has no column 'input_ids'"):
        check_source(CorpusConfig(source=str(no_ids), records="tokenized"))
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(conversations()).save_to_disk(str(tmp_path / "ds"))
    check_source(CorpusConfig(source=str(tmp_path / "ds")))
    with pytest.raises(DataError, match="is not a Hugging Face datasets directory"):
        check_source(CorpusConfig(source=str(tmp_path / "x"), format="hf_dataset"))


def test_the_step_and_start_lines_say_how_many_tokens_carry_loss():
    from flexorch.cli.train_console import _describe_setup, format_step

    ev = {
        "step": 1, "shape": "<2x2>", "solve_s": 0.4, "loss": 5.1, "tokens_per_s": 1000.0, "predicted_ms": 700.0,
        "compute_ms": 710.0, "measured_ms": 720.0, "eta_s": 3.0, "tokens": 7060, "targets": 527,
    }  # fmt: skip
    assert "loss  5.1000 on 527 of 7,060 tokens  tok/s" in format_step(ev, 4)
    assert "loss  5.1000  tok/s" in format_step({**ev, "targets": 7060}, 4)  # plain text: nothing to add
    setup = {
        "corpus": {"tokens": 41244, "records_kind": "chat", "targets": 9876}, "num_docs": 130, "workers": 4,
        "min_workers": 4, "max_workers": 4, "model_params": 1e6, "batches_per_epoch": 9, "profile": "p",
        "tokens_per_worker": 512,
    }  # fmt: skip
    assert "corpus 130 chat documents, 41,244 tokens, 9,876 of them loss targets;" in _describe_setup(setup)


def test_flexorch_plan_reads_the_lengths_training_would_see_from_chat_and_tokenized_jsonl(tmp_path):
    from flexorch.data.errors import DataError
    from flexorch.data.lengths import read_lengths
    from tests.chat_helpers import prompt_completions, tokenized_rows, write_jsonl

    for kind, rows in (("chat", conversations()), ("prompt_completion", prompt_completions())):
        got = read_lengths(write_jsonl(tmp_path / f"{kind}.jsonl", rows)).tolist()
        assert got == [len(encode_record(kind, r, BYTE, CFG)) for r in rows]
    rows = tokenized_rows()
    assert read_lengths(write_jsonl(tmp_path / "tok.jsonl", rows)).tolist() == [len(r["input_ids"]) for r in rows]
    bad = write_jsonl(tmp_path / "bad.jsonl", [conversations()[0], {"messages": [{"role": "user", "content": "?"}]}])
    with pytest.raises(DataError, match="bad.jsonl:2: chat record does not fit: no assistant turn"):
        read_lengths(bad)
