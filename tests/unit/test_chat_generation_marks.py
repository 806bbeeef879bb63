"""A chat template's ``{% generation %}`` marks decide its loss targets, checked against Transformers' own
``apply_chat_template(..., return_dict=True, return_assistant_tokens_mask=True)`` (the oracle); a template without
marks keeps the prefix rule. Four templates: with and without marks, with and without an assistant header on
``add_generation_prompt``. Fast: no Ray; small BPE tokenizers trained here, nothing downloaded."""

from __future__ import annotations

import numpy as np
import pytest

from flexorch.config import CorpusConfig
from flexorch.data.chat import TARGET_RULES, _span_ids, _template_spans, chat_tokens, target_rule
from flexorch.data.tokenizer import ByteTokenizer
from tests.chat_helpers import chat_tokenizer_dir, conversations

pytest.importorskip("transformers")

_OTHER = "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
_HEADER = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


def _template(answer: str, header: bool) -> str:
    return (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}" + answer + "{% else %}" + _OTHER + "{% endif %}"
        "{% endfor %}" + (_HEADER if header else "")
    )


TEMPLATES = {
    # ChatML, the header on add_generation_prompt: the prefix rule's answer is content + '<|im_end|>\n'
    "plain_header": _template(_OTHER, header=True),
    # the same without the header on add_generation_prompt: the prefix rule counts the header as answer
    "plain_bare": _template(_OTHER, header=False),
    # marks around what the prefix rule takes from plain_header: the same targets
    "marks_header": _template(
        "<|im_start|>assistant\n{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}", header=True
    ),
    # the template (TRL's style): marks around content + '<|im_end|>', no header on add_generation_prompt
    "marks_bare": _template(
        "<|im_start|>assistant\n{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}",
        header=False,  # (Transformers' Jinja drops a newline right after a block tag: trim_blocks)
    ),
}


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    from flexorch.data.tokenizer import HFTokenizer

    root = tmp_path_factory.mktemp("marks")
    return {name: HFTokenizer(str(chat_tokenizer_dir(root / name, t))) for name, t in TEMPLATES.items()}


def _transformers(tok, messages) -> tuple[list[int], list[int]]:
    out = tok._tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def _prefix_rule(tok, messages) -> tuple[list[int], list[bool]]:
    """What flexorch gave before the marks decided: the prefix rule's spans, tokenized span by span, BOS first."""
    ids, flags = _span_ids(*_template_spans(messages, tok), tok)
    return [tok.bos_id, *ids], [False, *flags]


def _runs(tok, ids, flags) -> list[str]:
    """The target runs, each decoded."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], np.asarray(flags, dtype=np.int8), [0]])))
    return [tok._tok.decode([int(i) for i in ids[a:b]]) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def test_the_rule_is_read_from_the_template(toks):
    for row in conversations()[:3]:  # the marks change no character of the rendering
        for marked, plain in (("marks_header", "plain_header"), ("marks_bare", "plain_bare")):
            for gen in (False, True):
                text = toks[marked].render_chat(row["messages"], gen)
                assert text == toks[plain].render_chat(row["messages"], gen)
    assert {n: target_rule(t) for n, t in toks.items()} == {
        "plain_header": "prefix",
        "plain_bare": "prefix",
        "marks_header": "marks",
        "marks_bare": "marks",
    }
    assert target_rule(ByteTokenizer()) == "builtin"

    class Tok:
        chat_template = None

    for mark, rule in (("{%- generation %}", "marks"), ("{%-generation-%}", "marks"), ("{# generation #}", "prefix")):
        Tok.chat_template = f"x{mark}y"
        assert target_rule(Tok) == rule
    Tok.chat_template = {"default": "{% generation %}", "tool_use": "x"}  # named templates: 'default' is rendered
    assert target_rule(Tok) == "marks"
    assert set(TARGET_RULES) == {"marks", "prefix", "builtin"}


@pytest.mark.parametrize("name", ["marks_header", "marks_bare"])
def test_marked_templates_train_exactly_on_transformers_assistant_mask(toks, name):
    tok = toks[name]
    for row in conversations():
        ids, flags = chat_tokens(row["messages"], tok)
        hf_ids, hf_mask = _transformers(tok, row["messages"])
        assert ids[0] == tok.bos_id and not flags[0]  # BOS first as before (the template does not write it)
        assert ids[1:].tolist() == hf_ids and flags[1:].astype(int).tolist() == hf_mask
        # the ids are the ones flexorch gave before: only which of them are targets changed
        assert ids.tolist() == _prefix_rule(tok, row["messages"])[0]
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        end = "<|im_end|>\n" if name == "marks_header" else "<|im_end|>"
        assert _runs(tok, ids, flags) == [a + end for a in answers]
        every, _ = chat_tokens(row["messages"], tok, loss_on="all")
        assert every.tolist() == ids.tolist()


def test_templates_without_marks_keep_the_prefix_rule(toks):
    for row in conversations():
        msgs = row["messages"]
        answers = [m["content"] for m in msgs if m["role"] == "assistant"]
        for name in ("plain_header", "plain_bare"):
            ids, flags = chat_tokens(msgs, toks[name])
            want_ids, want_flags = _prefix_rule(toks[name], msgs)
            assert ids.tolist() == want_ids and flags.tolist() == want_flags
        # without a header on add_generation_prompt the prefix rule counts it as answer
        ids, flags = chat_tokens(msgs, toks["plain_bare"])
        assert _runs(toks["plain_bare"], ids, flags) == [f"<|im_start|>assistant\n{a}<|im_end|>\n" for a in answers]
        # with it, the answers are what Transformers marks on the equivalent marked template
        ids, flags = chat_tokens(msgs, toks["plain_header"])
        hf_ids, hf_mask = _transformers(toks["marks_header"], msgs)
        assert ids[1:].tolist() == hf_ids and flags[1:].astype(int).tolist() == hf_mask


def test_the_masked_loss_equals_transformers_on_the_marked_template_without_a_header(toks):
    """Transformers' causal-LM loss (``ForCausalLMLoss``, what ``model(input_ids, labels=...)`` computes, label shift
    included) over the same logits: the labels from flexorch's targets and from Transformers' mask give the same
    loss; the prefix rule's did not (it trained on the header)."""
    import torch
    from transformers.loss.loss_utils import ForCausalLMLoss

    tok = toks["marks_bare"]
    gen = torch.Generator().manual_seed(0)

    def loss(logits, ids, flags) -> float:
        x = torch.tensor([[int(i) for i in ids]], dtype=torch.long)
        labels = torch.where(torch.tensor([[bool(f) for f in flags]]), x, -100)
        return float(ForCausalLMLoss(logits, labels, vocab_size=tok.vocab_size))

    worst_now, worst_before = 0.0, 0.0
    for row in conversations():
        ids, flags = chat_tokens(row["messages"], tok)
        _, hf_mask = _transformers(tok, row["messages"])
        logits = torch.randn(1, len(ids), tok.vocab_size, generator=gen, dtype=torch.float64)
        want = loss(logits, ids, [0, *hf_mask])
        worst_now = max(worst_now, abs(loss(logits, ids, flags) - want) / want)
        worst_before = max(worst_before, abs(loss(logits, *_prefix_rule(tok, row["messages"])) - want) / want)
    assert worst_now < 1e-7
    assert worst_before > 1e-3  # the issue: the header counted as answer


def test_a_store_of_marked_chat_records_is_prepared_again_and_the_start_line_names_the_rule(toks, tmp_path):
    from flexorch.cli.train_console import _describe_setup
    from flexorch.data.listing import list_source
    from flexorch.data.store.fingerprint import fingerprints
    from tests.chat_helpers import write_jsonl

    src = write_jsonl(tmp_path / "chat.jsonl", conversations())
    settings = {}
    for name, tok in toks.items():
        cfg = CorpusConfig(source=str(src), tokenizer=tok.name, records="chat")
        settings[name] = fingerprints(cfg, list_source(cfg), "chat")["settings"]
        all_cfg = CorpusConfig(source=str(src), tokenizer=tok.name, records="chat", loss_on="all")
        assert "chat_targets" not in fingerprints(all_cfg, list_source(all_cfg), "chat")["settings"]
    assert {n: s.get("chat_targets") for n, s in settings.items()} == {
        "plain_header": None,  # stores of templates without marks keep their keys
        "plain_bare": None,
        "marks_header": "marks",
        "marks_bare": "marks",
    }
    setup = {
        "corpus": {"tokens": 41244, "records_kind": "chat", "targets": 9876, "chat_targets": "marks"},
        "num_docs": 130, "workers": 4, "min_workers": 4, "max_workers": 4, "model_params": 1e6,
        "batches_per_epoch": 9, "profile": "p", "tokens_per_worker": 512,
    }  # fmt: skip
    line = _describe_setup(setup)
    assert "9,876 of them loss targets (set by the chat template's {% generation %} marks);" in line
    setup["corpus"]["chat_targets"] = "prefix"
    assert "loss targets (set by the prefix rule: the template has no generation marks);" in _describe_setup(setup)
    tasks = {"a": {"documents": 3, "records_kind": "chat", "chat_targets": "marks"}, "b": {"documents": 2}}
    setup["corpus"] = {"tokens": 10, "targets": 4, "tasks": tasks}
    assert "4 of them loss targets (set by the chat template's {% generation %} marks)" in _describe_setup(setup)
