"""Chat records -> token ids and loss targets: the tokenizer's own chat template, loss on the assistant turns.

A template that marks its answers with ``{% generation %}`` ... ``{% endgeneration %}`` says itself which tokens
they are, and its marks decide: the targets are exactly the tokens Transformers' ``apply_chat_template(...,
return_dict=True, return_assistant_tokens_mask=True)`` marks in ``assistant_masks`` (the oracle, taken from
Transformers itself; TRL's assistant-only loss trains on the same mask), over the ids it gives, the whole rendering
tokenized at once (what ``loss_on = "all"`` gives too; a token that overlaps an answer is a target). Whatever the
template renders outside the marks, e.g. an assistant header it writes with the answer and not on
``add_generation_prompt``, carries no loss.

Without marks, which characters of the rendered conversation belong to an answer is found the way the template
itself defines it, without per-template rules: the text up to assistant turn k is ``render(messages[:k],
add_generation_prompt=True)`` (the prompt the model would be given), and the text through it is
``render(messages[:k + 1])``; both must be prefixes of the whole conversation's rendering (true of the templates
of Llama, Mistral, Qwen2 and ChatML; a template that rewrites earlier turns, e.g. one that strips reasoning
from past answers, is refused per record with that reason). The answer's span is the difference: its content and
the template's end-of-turn marker, which the model must learn to emit. The text is then tokenized span by span,
so no token straddles a prompt and an answer (the prefix rule).

A tokenizer without a chat template (``byte``, a BPE trained on the corpus) gets a ChatML-style built-in one:
``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per turn, roles system, user, assistant and tool.

A record that does not fit is a :class:`BadRecord` with the reason: not a list of ``{role, content}`` turns, no
assistant turn, a role the template refuses or drops (a message whose content is not in the rendered text).
"""

from __future__ import annotations

import re

import numpy as np

__all__ = [
    "ANSWER_ROLE",
    "BUILTIN_ROLES",
    "GENERATION_MARK",
    "TARGET_RULES",
    "BadRecord",
    "chat_tokens",
    "check_messages",
    "target_rule",
]

ANSWER_ROLE = "assistant"
BUILTIN_ROLES = ("system", "user", "assistant", "tool")
GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""An answer mark, as Transformers' ``render_jinja_template`` tests for one before ``return_assistant_tokens_mask``."""
TARGET_RULES = {
    "marks": "the chat template's {% generation %} marks",
    "prefix": "the prefix rule: the template has no generation marks",
    "builtin": "the built-in ChatML template",
}
"""What decides a chat record's loss targets (:func:`target_rule`), in words for the run's start line."""


class BadRecord(ValueError):
    """A record that does not fit its kind; the message says why (it is reported with the record's place)."""


def check_messages(messages) -> list[dict]:
    """``messages`` as a list of ``{"role": str, "content": str}`` (other keys dropped), or :class:`BadRecord`."""
    if not isinstance(messages, list | tuple) or not messages:
        raise BadRecord(f"messages must be a non-empty list of {{role, content}} turns, got {_short(messages)}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRecord(f"message {i} must be an object with string 'role' and 'content', got {_short(m)}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def chat_tokens(messages, tok, loss_on: str = "answers") -> tuple[np.ndarray, np.ndarray]:
    """(ids int32, targets bool) of one conversation; BOS first when the tokenizer has one (once: a template that
    writes BOS itself keeps its own). ``loss_on``: 'answers' (assistant turns) or 'all'."""
    messages = check_messages(messages)
    if not any(m["role"] == ANSWER_ROLE for m in messages):
        raise BadRecord(f"no {ANSWER_ROLE} turn: nothing to train on (roles: {', '.join(m['role'] for m in messages)})")
    rule = target_rule(tok)
    if rule == "marks":
        text, ids, flags = _marked(messages, tok)
        if loss_on == "all":
            flags = [True] * len(ids)
    else:
        text, spans = _template_spans(messages, tok) if rule == "prefix" else _builtin_spans(messages)
        if loss_on == "all":
            spans = [(0, len(text))]
        ids, flags = _span_ids(text, spans, tok)
    if tok.bos_id is not None and not (tok.bos_text and text.startswith(tok.bos_text)):
        ids, flags = [tok.bos_id, *ids], [False, *flags]
    return np.asarray(ids, dtype=np.int32), np.asarray(flags, dtype=bool)


def target_rule(tok) -> str:
    """'marks' (the chat template has ``{% generation %}`` marks), 'prefix' (a template without them) or 'builtin'
    (no template: flexorch's ChatML-style one); :data:`TARGET_RULES` says each in words."""
    template = tok.chat_template
    if isinstance(template, dict):  # named templates: Transformers renders 'default' when no tools are given
        template = template.get("default")
    if not template:
        return "builtin"
    return "marks" if GENERATION_MARK.search(template) else "prefix"


def _span_ids(text: str, spans: list[tuple[int, int]], tok) -> tuple[list[int], list[bool]]:
    ids, flags, cut = [], [], 0
    for a, b in [*spans, (len(text), len(text))]:
        for part, is_target in ((text[cut:a], False), (text[a:b], True)):
            if part:
                part_ids = tok.encode_text(part)
                ids += part_ids
                flags += [is_target] * len(part_ids)
        cut = b
    return ids, flags


def _marked(messages: list[dict], tok) -> tuple[str, list[int], list[bool]]:
    full = _template(tok.render_chat, messages, False)
    _check_rendered(full, messages)
    ids, mask = _template(tok.chat_answer_mask, messages)  # Transformers' return_assistant_tokens_mask: the oracle
    return full, ids, [bool(v) for v in mask]


def _builtin_spans(messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    parts, spans, at = [], [], 0
    for i, m in enumerate(messages):
        if m["role"] not in BUILTIN_ROLES:
            raise BadRecord(
                f"role {m['role']!r} (message {i}) is not one the built-in chat template knows "
                f"({', '.join(BUILTIN_ROLES)}); use a tokenizer with its own chat template for other roles"
            )
        head, body = f"<|im_start|>{m['role']}\n", f"{m['content']}<|im_end|>\n"
        if m["role"] == ANSWER_ROLE:
            spans.append((at + len(head), at + len(head) + len(body)))
        parts += [head, body]
        at += len(head) + len(body)
    return "".join(parts), spans


def _template(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a template's own refusal (raise_exception) names the problem
        raise BadRecord(f"the chat template refused it: {type(e).__name__}: {str(e)[:200]}") from None


def _check_rendered(full: str, messages: list[dict]) -> None:
    at = 0
    for i, m in enumerate(messages):  # a role the template does not know and silently drops
        if m["content"]:
            found = full.find(m["content"], at)
            if found < 0:
                raise BadRecord(
                    f"message {i} (role {m['role']!r}) is not in what the chat template renders: a role it does not "
                    "know, or a turn it rewrites"
                )
            at = found + len(m["content"])


def _template_spans(messages: list[dict], tok) -> tuple[str, list[tuple[int, int]]]:
    def render(msgs, gen):
        return _template(tok.render_chat, msgs, gen)

    full = render(messages, False)
    _check_rendered(full, messages)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != ANSWER_ROLE:
            continue
        through = render(messages[: k + 1], False)
        before = (
            next((p for p in (render(messages[:k], True), render(messages[:k], False)) if through.startswith(p)), None)
            if k
            else ""
        )
        if before is None or not full.startswith(through) or len(through) <= len(before):
            raise BadRecord(
                f"the chat template does not render this conversation turn by turn (answer {k} changes the text "
                "before it), so its answers cannot be told from its prompts"
            )
        spans.append((len(before), len(through)))
    return full, spans


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
