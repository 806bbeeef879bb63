"""Shared pieces of the loss-mask tests: a tokenizer directory with a chat template, small chat/prompt-completion/
tokenized data sets, and the files they are written as (JSONL, Parquet, a ``datasets`` ``save_to_disk``
directory)."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML, refusing roles it does not know (as Qwen2's and Llama 3's templates do with ``raise_exception``)."""
DROPS_ROLES = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'assistant' %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
"""Llama 2 style: writes BOS itself, and silently drops any role but user and assistant."""

TALK = (
    "the planner splits the devices into groups of different sizes for every step while short sequences "
    "stop paying for communication and long ones get the memory they need so the loss stays the same"
).split()


def words(i: int, n: int) -> str:
    return " ".join(TALK[(i * 7 + k) % len(TALK)] for k in range(n))


def conversations() -> list[dict]:
    """Short and long conversations, with a system turn, several answers, and one far longer than the rest."""
    rows = []
    for i in range(10):
        turns = [{"role": "system", "content": "answer briefly"}] if i % 3 == 0 else []
        for t in range(1 + i % 3):
            turns += [
                {"role": "user", "content": f"question {i}.{t}: {words(i + t, 3 + (i * t) % 5)}?"},
                {"role": "assistant", "content": words(i * 3 + t, 2 + (i + t) % 6)},
            ]
        rows.append({"messages": turns})
    long = []
    for t in range(6):
        long += [
            {"role": "user", "content": f"part {t}: {words(t, 14)}"},
            {"role": "assistant", "content": words(t + 5, 9)},
        ]
    rows.insert(4, {"messages": long})
    return rows


def prompt_completions() -> list[dict]:
    return [
        {"prompt": f"Q{i}: {words(i, 2 + i % 7)}? A:", "completion": " " + words(i + 11, 1 + i % 5)} for i in range(11)
    ]


def tokenized_rows(vocab: int = 250) -> list[dict]:
    """Pre-tokenized rows: labels with -100 on a prompt, a loss mask, and one without either."""
    rows = []
    for i in range(11):
        n = 6 + (i * 13) % 40 + (90 if i == 5 else 0)
        ids = [(i * 31 + k * 17) % vocab for k in range(n)]
        cut = n // 3
        if i % 3 == 0:
            rows.append({"input_ids": ids, "labels": [-100] * cut + ids[cut:]})
        elif i % 3 == 1:
            rows.append({"input_ids": ids, "loss_mask": [0] * cut + [1] * (n - cut)})
        else:
            rows.append({"input_ids": ids})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    cols = sorted({k for r in rows for k in r})
    pq.write_table(pa.table({c: [r.get(c) for r in rows] for c in cols}), path)
    return path


def chat_tokenizer_dir(path: Path, template: str = CHATML) -> Path:
    """A byte-level BPE tokenizer directory (trained here, a few hundred ids) with ``<s>``, ``</s>``,
    ``<|im_start|>`` and ``<|im_end|>`` as special tokens and ``template`` as its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([" ".join(TALK)] * 4 + ["question answer part system user assistant"], trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    wrapped.add_special_tokens({"additional_special_tokens": specials[2:]})
    wrapped.chat_template = template
    wrapped.save_pretrained(str(path))
    return path
