"""What one record holds, and how it becomes stored tokens: text, chat, prompt/completion or pre-tokenized.

`[data] records` (``flexorch.config.data.RECORD_KINDS``) says what a JSONL line, Parquet row or ``datasets``
row holds; 'auto' sniffs it from the first record's fields (:func:`resolve_kind`). :func:`encode_record` turns one
record into the int32 array the corpus stores (``flexorch.data.targets``: a token that carries no loss is stored
as ``~id``), or raises :class:`~flexorch.data.chat.BadRecord` with the reason, which the load reports with the
record's file and line or row under ``on_bad_record``. :func:`exchange_pieces` splits an over-long masked
document only where an answer ends, so every piece keeps each answer with its own prompt.

No Ray: the packing tasks (``flexorch.data.readers``) and the pre-flight check run it.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import numpy as np

from flexorch.data.chat import BadRecord, chat_tokens
from flexorch.data.errors import DataError
from flexorch.data.targets import count_targets, encode_targets

if TYPE_CHECKING:
    from flexorch.config.data import CorpusConfig

__all__ = [
    "BadRecord",
    "encode_record",
    "exchange_pieces",
    "kind_fields",
    "record_text",
    "resolve_kind",
    "sniff_kind",
]

IGNORE_LABEL = -100


def kind_fields(kind: str, cfg: CorpusConfig) -> tuple[str, ...]:
    """The record fields a kind reads; the first is the one a record must have (missing: no document)."""
    if kind == "chat":
        return (cfg.messages_field,)
    if kind == "prompt_completion":
        return (cfg.completion_field, cfg.prompt_field)
    if kind == "tokenized":
        return (cfg.input_ids_field, cfg.labels_field, cfg.loss_mask_field)
    return (cfg.text_field,)


def sniff_kind(columns, cfg: CorpusConfig) -> str:
    """The kind a record with these field names holds (``records = "auto"``)."""
    cols = set(columns)
    if cfg.messages_field in cols:
        return "chat"
    if {cfg.prompt_field, cfg.completion_field} <= cols:
        return "prompt_completion"
    if cfg.input_ids_field in cols:
        return "tokenized"
    return "text"


def resolve_kind(listing, cfg: CorpusConfig) -> str:
    """``cfg.records``, or for 'auto' the kind of the source's first record (text files are always 'text')."""
    if cfg.records != "auto":
        if listing.fmt == "text" and cfg.records != "text":
            raise DataError(
                f"records = {cfg.records!r} needs JSONL, Parquet or a datasets directory; {listing.source} is read as "
                "text files (set format if it is JSONL or Parquet)"
            )
        return cfg.records
    if listing.fmt == "text":
        return "text"
    return sniff_kind(_first_columns(listing), cfg)


def _first_columns(listing) -> list[str]:
    if listing.fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_schema(listing.files[0]).names
    if listing.fmt == "hf_dataset":
        import pyarrow as pa

        with pa.memory_map(listing.files[0]) as src:
            return pa.ipc.open_stream(src).schema.names
    for f in listing.files:  # JSONL: the first line that parses as an object
        with open(f, "rb") as fh:
            for raw in fh:
                if raw.strip():
                    try:
                        obj = json.loads(raw)
                    except ValueError:
                        continue
                    if isinstance(obj, dict):
                        return list(obj)
    return []


def record_text(kind: str, value: dict, cfg: CorpusConfig) -> str | None:
    """The natural-language text of a chat or prompt/completion record (its turns' contents, or prompt and
    completion, one per line), None if it has none: what a BPE trained on the corpus learns from."""
    if kind == "chat":
        msgs = value.get(cfg.messages_field)
        parts = [m.get("content") for m in msgs if isinstance(m, dict)] if isinstance(msgs, list) else []
    else:
        parts = [value.get(cfg.prompt_field), value.get(cfg.completion_field)]
    parts = [p for p in parts if isinstance(p, str) and p]
    return "\n".join(parts) or None


def encode_record(kind: str, value, tok, cfg: CorpusConfig) -> np.ndarray:
    """Stored int32 tokens of one record (``value``: the text as bytes for 'text', else a dict of
    :func:`kind_fields`); raises :class:`BadRecord` when it does not fit, or has no token to train on."""
    if kind == "text":
        return tok.encode(value)
    if kind == "chat":
        ids, flags = chat_tokens(value.get(cfg.messages_field), tok, cfg.loss_on)
    elif kind == "prompt_completion":
        ids, flags = _prompt_completion(value, tok, cfg)
    else:
        ids, flags = _tokenized(value, cfg)
    stored = encode_targets(ids, None if cfg.loss_on == "all" else flags)
    if count_targets(stored) == 0:
        raise BadRecord("no token carries loss (every label is masked, or the answer is empty)")
    return stored


def _prompt_completion(value: dict, tok, cfg: CorpusConfig) -> tuple[np.ndarray, np.ndarray]:
    prompt, completion = value.get(cfg.prompt_field), value.get(cfg.completion_field)
    for name, v in ((cfg.prompt_field, prompt), (cfg.completion_field, completion)):
        if not isinstance(v, str):
            raise BadRecord(f"field {name!r} must be a string, got {type(v).__name__}")
    if not completion:
        raise BadRecord(f"field {cfg.completion_field!r} is empty: nothing to train on")
    head = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode_text(prompt)
    tail = tok.encode_text(completion) + ([tok.eos_id] if tok.eos_id is not None else [])
    flags = np.zeros(len(head) + len(tail), dtype=bool)
    flags[len(head) :] = True
    return np.asarray(head + tail, dtype=np.int32), flags


def _int_list(values, name: str) -> np.ndarray:
    if values is None or isinstance(values, str | bytes | dict) or not hasattr(values, "__len__"):
        raise BadRecord(f"field {name!r} must be a list of integers, got {type(values).__name__}")
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError):
        raise BadRecord(f"field {name!r} must be a flat list of integers") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iub"):
        raise BadRecord(f"field {name!r} must be a flat list of integers, got {arr.dtype} of shape {arr.shape}")
    return arr.astype(np.int64)


def _tokenized(value: dict, cfg: CorpusConfig) -> tuple[np.ndarray, np.ndarray]:
    ids = _int_list(value.get(cfg.input_ids_field), cfg.input_ids_field)
    if not ids.size:
        raise BadRecord(f"field {cfg.input_ids_field!r} is empty")
    if ids.min() < 0 or ids.max() > np.iinfo(np.int32).max:
        raise BadRecord(f"field {cfg.input_ids_field!r} holds id {int(ids.min() if ids.min() < 0 else ids.max())}")
    labels, mask = value.get(cfg.labels_field), value.get(cfg.loss_mask_field)
    if labels is not None and mask is not None:
        raise BadRecord(f"has both {cfg.labels_field!r} and {cfg.loss_mask_field!r}; keep one")
    if labels is not None:
        lab = _int_list(labels, cfg.labels_field)
        if lab.shape != ids.shape:
            raise BadRecord(f"{cfg.labels_field!r} has {lab.size} entries, {cfg.input_ids_field!r} has {ids.size}")
        wrong = (lab != IGNORE_LABEL) & (lab != ids)
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            raise BadRecord(
                f"{cfg.labels_field!r}[{i}] is {int(lab[i])}: a label must be its input id or {IGNORE_LABEL} "
                "(Transformers' causal-LM convention: labels aligned with input_ids, shifted by the model)"
            )
        flags = lab != IGNORE_LABEL
    elif mask is not None:
        m = _int_list(mask, cfg.loss_mask_field)
        if m.shape != ids.shape:
            raise BadRecord(f"{cfg.loss_mask_field!r} has {m.size} entries, {cfg.input_ids_field!r} has {ids.size}")
        if ((m != 0) & (m != 1)).any():
            raise BadRecord(f"{cfg.loss_mask_field!r} must hold only 0 and 1")
        flags = m == 1
    else:
        flags = np.ones(ids.size, dtype=bool)
    return ids.astype(np.int32), flags


def exchange_pieces(stored: np.ndarray, max_context: int) -> tuple[list[np.ndarray], int] | None:
    """Split a masked document longer than ``max_context`` where an answer ends (a target followed by a
    non-target), packing whole exchanges greedily: (pieces that carry loss, pieces dropped because they hold
    none, e.g. a trailing question). None: one exchange alone is longer than ``max_context`` (the record is
    dropped: no split keeps that answer with its prompt)."""
    flags = stored >= 0
    ends = np.flatnonzero(flags[:-1] & ~flags[1:]) + 1  # first token after each answer
    bounds = [0, *ends.tolist(), len(stored)]
    pieces, start, last = [], 0, 0
    for b in bounds[1:]:
        if b - last > max_context:
            return None
        if b - start > max_context:
            pieces.append(stored[start:last])
            start = last
        last = b
    pieces.append(stored[start:])
    kept = [p for p in pieces if count_targets(p) > 0]
    return kept, len(pieces) - len(kept)
