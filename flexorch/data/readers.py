"""Building a corpus: records -> tokenized, split documents with their loss targets -> the document index.

A prepare (``flexorch.data.store.prepare``) runs two steps of this module: `pack_records`, in each work unit's
task, validates, tokenizes and splits the unit's documents and yields ``int32`` buffers of about ``block_tokens``
tokens (which the task writes to its block) and then a small metadata dict; `assemble_index`, in the preparing
process, merges the units' metadata, checks it (a malformed record named by file and line, a wrong text field,
documents over ``max_context``) and numbers the documents by sorted (path, record, piece), independent of the
order in which units finished. `list_source` (``flexorch.data.listing``, re-exported here) says which files and
which format.

JSONL is split into records in `pack_records` by `flexorch.data.source_records`, which parses each line and names a
malformed one (file and line). A null or missing text field is `skipped_no_text`, governed by `bad_files`.

Quiet Ray Data: prepares run inside Ray actors and `flexorch train`, where Ray Data's execution banners, progress
bars/logs and stats dumps are noise. `quiet_ray_data` gives a copy of the current `DataContext` with those off and
holds the `ray.data` loggers at WARNING (so DEBUG/INFO records do not reach Ray Data's session log file either); the
previous context and levels come back when the block ends.

Why one module for packing and indexing: the packing and the index share the record layout and the status codes
(`_OK` ... `_BAD`, the skip counters), and each is read against the other.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import TYPE_CHECKING

import numpy as np

from flexorch.data.chat import target_rule
from flexorch.data.errors import DataError
from flexorch.data.listing import Listing, list_source
from flexorch.data.record_kinds import BadRecord, encode_record, exchange_pieces, kind_fields
from flexorch.data.source_records import bad_record_error, block_records, is_utf8
from flexorch.data.targets import count_targets, token_ids
from flexorch.data.tokenizer import get_tokenizer

if TYPE_CHECKING:
    from flexorch.config.data import CorpusConfig

__all__ = [
    "Listing",
    "list_source",
    "pack_records",
    "assemble_index",
    "quiet_ray_data",
]

_OK, _SPLIT, _BINARY, _EMPTY, _OVER_LONG, _REJECT, _NO_TEXT, _BAD = range(8)
_REASONS = {_BINARY: "skipped_binary", _EMPTY: "skipped_empty", _NO_TEXT: "skipped_no_text", _BAD: "bad_records"}
_REASONS |= {_OVER_LONG: "dropped_over_long", _SPLIT: "split_docs"}
_NO_FIELD = {"chat": "messages_field", "prompt_completion": "completion_field", "tokenized": "input_ids_field"}
"""The setting that names the field a record of each kind must have (``text_field`` for text)."""
# Logger -> the least level it is held at during a read. Turning progress bars off makes Ray Data warn once per
# process that they are off (a WARNING from its progress module), hence ERROR there.
_QUIET_LOGGERS = {"ray.data": logging.WARNING, "ray.data._internal.progress": logging.ERROR}


@contextlib.contextmanager
def quiet_ray_data():
    """Within the block: a copy of the current `DataContext` without progress output or stats logs, and the
    `ray.data` loggers at WARNING or above; yields that context. The previous context and levels come back after.
    """
    from ray.data import DataContext

    ctx = DataContext.get_current().copy()
    ctx.enable_progress_bars = False  # no tqdm bars, no progress log lines, no "new progress UI" hint
    ctx.print_on_execution_start = False  # no "Starting execution of Dataset ..." / "Execution plan ..."
    ctx.enable_auto_log_stats = False  # no per-operator stats summary after execution
    ctx.verbose_stats_logs = False
    loggers = {logging.getLogger(name): level for name, level in _QUIET_LOGGERS.items()}
    saved = {lg: lg.level for lg in loggers}
    with DataContext.current(ctx):
        try:
            for lg, level in loggers.items():
                if lg.getEffectiveLevel() < level:
                    lg.setLevel(level)
            yield ctx
        finally:
            for lg, level in saved.items():
                lg.setLevel(level)


def field_of(kind: str, cfg: CorpusConfig) -> str:
    """The field every record of ``kind`` must have."""
    return getattr(cfg, _NO_FIELD.get(kind, "text_field"))


def _record_pieces(r: int, data, malformed: bool, kind: str, tok, cfg: CorpusConfig, info: dict):
    """One record's status, token count, pieces to store and pieces dropped as too short (`pack_records`)."""
    max_context, min_tokens, over_long, on_bad = cfg.max_context, cfg.min_tokens, cfg.over_long, cfg.on_bad_record
    status, n, pieces, short = _OK, 0, [], 0
    if malformed:
        status = _BAD
    elif data is None:
        status = _NO_TEXT
    elif kind == "text" and not data:
        status = _EMPTY
    elif kind == "text" and (b"\0" in data or not is_utf8(data)):
        status = _BINARY
    elif on_bad == "error" and (info["bad"] or info["bad_kind"]):
        pass  # the load fails: no need to tokenize the rest of this file
    else:
        try:
            ids = encode_record(kind, data, tok, cfg)
        except BadRecord as e:
            status, ids = _BAD, None
            info["bad_kind"].append((r, str(e)))
        n = 0 if ids is None else len(ids)
        if ids is None:
            pass
        elif n < min_tokens:
            status = _EMPTY
        elif n <= max_context:
            pieces = [ids]
        elif over_long == "split" and bool((ids < 0).any()):  # a loss mask: split only where an answer ends
            split = exchange_pieces(ids, max_context)
            if split is None:
                status = _OVER_LONG
            else:
                status, (pieces, short) = _SPLIT, split
        elif over_long == "split":
            status, cut = _SPLIT, [ids[i : i + max_context] for i in range(0, n, max_context)]
            pieces = [p for p in cut if len(p) >= min_tokens]
            short = len(cut) - len(pieces)
        else:
            status = _OVER_LONG if over_long == "drop" else _REJECT
    return status, n, pieces, short


def pack_records(table, spec: tuple, block_tokens: int):
    """Validate, tokenize and split one Arrow block's documents; yield int32 token buffers, then the metadata dict.

    JSONL and ``datasets`` rows are whole files: their records are read here. With on_bad_record='error' the task
    stops tokenizing at the first malformed record and returns after that file (the driver raises the error).
    Records of chat, prompt/completion and tokenized sources store their loss mask in the ids
    (``flexorch.data.targets``); their documents' target counts go to the metadata."""
    base, fmt, cfg, kind = spec
    fields = kind_fields(kind, cfg) if kind != "text" else None
    tok, prefix = get_tokenizer(cfg.tokenizer) if kind != "tokenized" else None, base.rstrip("/") + "/"
    info = {"bad_type": None, "bad_type_in": None, "columns": set(), "bad": [], "bad_kind": []}
    paths: dict[str, int] = {}
    rec = {"path": [], "row": [], "status": [], "tokens": [], "short": []}
    doc = {"rec": [], "piece": [], "block": [], "offset": [], "length": [], "targets": []}  # "block": its buffer
    buffer, fill, n_buffers, max_id = [], 0, 0, -1
    rel_of = lambda path: path[len(prefix) :] if path.startswith(prefix) else path  # noqa: E731
    records = block_records(table, fmt, cfg.text_field, info, rel_of, cfg.on_bad_record == "error", fields)
    for r, (path, row, data, malformed) in enumerate(records):
        rel = rel_of(path)
        status, n, pieces, short = _record_pieces(r, data, malformed, kind, tok, cfg, info)
        for k, piece in enumerate(pieces):
            if fill and fill + len(piece) > block_tokens:
                yield np.concatenate(buffer)
                buffer, fill, n_buffers = [], 0, n_buffers + 1
            for key, v in zip(doc, (r, k, n_buffers, fill, len(piece), count_targets(piece)), strict=True):
                doc[key].append(v)
            buffer.append(piece)
            fill += len(piece)
            if kind == "tokenized":
                max_id = max(max_id, int(token_ids(piece).max()))
        for key, v in zip(rec, (paths.setdefault(rel, len(paths)), row, status, n, short), strict=True):
            rec[key].append(v)
    if fill:
        yield np.concatenate(buffer)
    meta = {f"rec_{k}": np.asarray(v, dtype=np.int64) for k, v in rec.items()}
    meta |= {f"doc_{k}": np.asarray(v, dtype=np.int64) for k, v in doc.items()}
    columns = sorted(info["columns"]) if fmt in ("jsonl", "hf_dataset") else table.column_names
    yield (
        meta
        | {"paths": list(paths), "columns": columns, "bad": info["bad"][:5], "bad_kind": info["bad_kind"][:5]}
        | {k: info[k] for k in ("bad_type", "bad_type_in")}
        | {"max_id": max_id}
    )


class _Keys:
    """The merged records' keys as a message names them: ``path`` (text), ``path:line`` (JSONL), ``path:row``."""

    def __init__(self, names: list[str], rec: dict, row: np.ndarray, fmt: str):
        self.names, self.rec, self.row, self.fmt = names, rec, row, fmt

    def base_key(self, r: int) -> str:
        """Record ``r``'s key."""
        p, row, fmt = self.names[self.rec["path"][r]], self.row, self.fmt
        return p if fmt == "text" else f"{p}:{row[r] + 1}" if fmt == "jsonl" else f"{p}:{row[r]}"

    def examples(self, mask: np.ndarray, suffix=lambda r: "") -> list[str]:
        """The first five (sorted) keys of the records in ``mask``."""
        return sorted(self.base_key(r) + suffix(r) for r in np.flatnonzero(mask))[:5]


def _merge_metas(cfg: CorpusConfig, metas: list[dict], block_refs: list[list]):
    """The units' metadata as one: path names, record and document columns, counts, columns seen, bad kinds."""
    paths: dict[str, int] = {}
    recs = {k: [] for k in ("path", "row", "status", "tokens", "short")}
    docs = {k: [] for k in ("rec", "piece", "block", "offset", "length", "targets")}
    n_rec, n_blk, columns, bad_kind = 0, 0, set(), []
    for meta, blocks in zip(metas, block_refs, strict=True):
        gid = np.asarray([paths.setdefault(p, len(paths)) for p in meta["paths"]] or [0], dtype=np.int64)
        if meta["bad_type"]:
            raise DataError(
                f"field {cfg.text_field!r} holds {meta['bad_type']} values, not text "
                f"(in {meta.get('bad_type_in') or meta['paths'][0]}); "
                "set text_field to the field that holds the document text"
            )
        columns |= set(meta["columns"]) - {"path"}
        bad_kind += [(r + n_rec, reason) for r, reason in meta["bad_kind"]]
        for k in recs:
            recs[k].append(gid[meta["rec_path"]] if k == "path" else meta[f"rec_{k}"])
        for k in docs:
            docs[k].append(meta[f"doc_{k}"] + {"rec": n_rec, "block": n_blk}.get(k, 0))
        n_rec, n_blk = n_rec + len(meta["rec_status"]), n_blk + len(blocks)
    rec = {k: np.concatenate(v) if v else np.zeros(0, np.int64) for k, v in recs.items()}
    doc = {k: np.concatenate(v) if v else np.zeros(0, np.int64) for k, v in docs.items()}
    return list(paths), rec, doc, n_rec, n_blk, columns, bad_kind


def _record_rows(fmt: str, rec: dict, n_rec: int) -> np.ndarray:
    """Each record's number inside its file (records arrive in file order)."""
    row = np.zeros(n_rec, dtype=np.int64)
    if fmt in ("jsonl", "hf_dataset"):  # numbered by _pack_block, which sees whole files
        row = rec["row"]
    elif fmt != "text" and n_rec:
        order = np.argsort(rec["path"], kind="stable")
        starts = np.searchsorted(rec["path"][order], rec["path"][order], side="left")
        row[order] = np.arange(n_rec) - starts
    return row


def _check_records(cfg, listing: Listing, metas: list[dict], kind: str, keys: _Keys, columns: set, bad_kind: list):
    """Raise the `DataError` for a missing field, a malformed record, a bad file or a rejected over-long document."""
    rec, row, names = keys.rec, keys.row, keys.names
    status = rec["status"]
    no_text = status == _NO_TEXT
    if no_text.any():
        per_path, missing = np.bincount(rec["path"], minlength=len(names)), np.bincount(rec["path"][no_text])
        setting = _NO_FIELD.get(kind, "text_field")
        for p in np.flatnonzero(missing == per_path[: len(missing)]):
            raise DataError(
                f"{names[p]}: no record has a {field_of(kind, cfg)!r} field (fields seen: "
                f"{', '.join(sorted(columns))}); set {setting} to the field that holds it"
                + ("" if kind == "text" else f" (records = {kind!r}; set records if they hold something else)")
            )
    parse_bad = [b for meta in metas for b in meta["bad"]]
    if cfg.on_bad_record == "error" and parse_bad:
        rel, line, reason = min(parse_bad)
        raise bad_record_error(os.path.join(listing.base, rel), line, reason)
    if cfg.on_bad_record == "error" and bad_kind:
        r, reason = min(bad_kind, key=lambda b: (rec["path"][b[0]], row[b[0]]))
        key = keys.base_key(r)
        raise DataError(
            f"{os.path.join(listing.base, key)}: {kind} record {key.rsplit(':', 1)[-1]} does not fit: "
            f'{reason}; fix or remove it, or set [data] on_bad_record = "skip" to skip such records (they are '
            "counted in the corpus stats)"
        )
    bad = (status == _BINARY) | no_text
    if cfg.bad_files == "error" and bad.any():
        raise DataError(
            f"{int(bad.sum())} document(s) are binary, not valid UTF-8, or have no text: "
            f"{', '.join(keys.examples(bad))}; remove them, or set bad_files='skip' to skip them (they are counted "
            "in Corpus.stats)"
        )
    if (status == _REJECT).any():
        r = int(np.flatnonzero(status == _REJECT)[0])
        raise DataError(
            f"{int((status == _REJECT).sum())} document(s) exceed max_context={cfg.max_context} tokens; the first is "
            f"{keys.base_key(r)} with {int(rec['tokens'][r])} tokens; set over_long='split' to cut them into pieces, "
            "over_long='drop' to skip them, or raise max_context"
        )


def _corpus_stats(cfg, listing: Listing, metas: list[dict], kind: str, tok_name: str, keys: _Keys, doc: dict, counts):
    """The corpus stats (without `load_s`): settings, what was read, skipped, split and kept, with examples."""
    (n_rec, n_blk, bad_kind), rec = counts, keys.rec
    status = rec["status"]
    stats = {"source": listing.source, "format": listing.fmt, "tokenizer": tok_name}
    stats |= {"max_context": cfg.max_context, "over_long": cfg.over_long, "files": len(listing.files)}
    stats |= {"skipped_hidden": listing.skipped_hidden, "skipped_extension": listing.skipped_extension}
    stats["records"] = n_rec
    stats["records_kind"] = kind
    if kind == "chat" and cfg.loss_on == "answers":  # what decides the loss targets (the run's start line says it)
        stats["chat_targets"] = target_rule(get_tokenizer(cfg.tokenizer))
    stats |= {name: int((status == s).sum()) for s, name in _REASONS.items()}
    stats |= {"pieces_added": int(np.isin(doc["rec"], np.flatnonzero(status == _SPLIT)).sum())}
    stats |= {"dropped_short_pieces": int(rec["short"].sum())}
    stats |= {"documents": len(doc["rec"]), "tokens": int(doc["length"].sum()), "blocks": n_blk}
    stats["max_doc_tokens"] = int(doc["length"].max()) if len(doc["length"]) else 0
    kept = np.bincount(doc["rec"], minlength=n_rec)
    ex = {name: keys.examples(status == s) for s, name in _REASONS.items()}
    ex["dropped_short_pieces"] = keys.examples(rec["short"] > 0, lambda r: f"#piece{kept[r]}")
    stats["examples"] = {k: v for k, v in ex.items() if v}
    if bad_kind:
        stats["bad_record_reasons"] = sorted(f"{keys.base_key(r)}: {reason}" for r, reason in bad_kind)[:5]
    stats["targets"] = int(doc["targets"].sum())
    if kind == "tokenized":
        stats["max_token_id"] = max(meta["max_id"] for meta in metas)
    return stats


def _check_not_empty(cfg, listing: Listing, stats: dict, n_docs: int) -> None:
    """Raise the `DataError` for a source with no records, or with no documents left after skipping."""
    n_rec = stats["records"]
    if not n_rec:
        raise DataError(
            f"{listing.source} is empty: its {len(listing.files)} file(s) hold no records (0 bytes or blank lines "
            "only); point source at your data"
        )
    if not n_docs:
        raise DataError(
            f"no documents left in {stats['source']} after skipping: {n_rec} read, {stats['skipped_binary']} binary, "
            f"{stats['skipped_empty']} empty or under min_tokens={cfg.min_tokens}, {stats['skipped_no_text']} "
            f"without text, {stats['bad_records']} malformed, {stats['dropped_over_long']} over "
            f"max_context={cfg.max_context}; point source at text data, or relax min_tokens / over_long"
        )


def assemble_index(
    cfg: CorpusConfig, listing: Listing, metas: list[dict], block_refs: list[list], tok_name: str, kind: str = "text"
):
    """Driver side: merge the per-block metadata, check it, number the documents by sorted key.

    Returns the `Corpus` fields other than the tokenizer's: keys (their components: ``flexorch.data.doc_keys``),
    lengths, targets (per document, None for text: every token after the first), doc_blocks, doc_offsets,
    block_refs (flattened) and stats (without `load_s`).
    """
    fmt = listing.fmt
    names, rec, doc, n_rec, n_blk, columns, bad_kind = _merge_metas(cfg, metas, block_refs)
    row = _record_rows(fmt, rec, n_rec)
    keys = _Keys(names, rec, row, fmt)
    _check_records(cfg, listing, metas, kind, keys, columns, bad_kind)
    stats = _corpus_stats(cfg, listing, metas, kind, tok_name, keys, doc, (n_rec, n_blk, bad_kind))
    _check_not_empty(cfg, listing, stats, len(doc["rec"]))
    rank = np.empty(len(names), dtype=np.int64)
    rank[np.argsort(np.asarray(names, dtype=object))] = np.arange(len(names))
    drec = doc["rec"]
    order = np.lexsort((doc["piece"], row[drec], rank[rec["path"][drec]]))
    split, drec = rec["status"] == _SPLIT, drec[order]
    return {
        "keys": {  # the components of each document's key (``flexorch.data.doc_keys``), not one string per document
            "names": names,
            "fmt": fmt,
            "path": rec["path"][drec].astype(np.int32),
            "row": row[drec],
            "piece": np.where(split[drec], doc["piece"][order], -1).astype(np.int32),
        },
        "lengths": doc["length"][order],
        "targets": None if kind == "text" else doc["targets"][order],
        "doc_blocks": doc["block"][order],
        "doc_offsets": doc["offset"][order],
        "block_refs": [ref for blocks in block_refs for ref in blocks],
        "stats": stats,
    }
