"""Pre-flight check of a corpus source with plain file reads, no Ray running: `flexorch train` refuses a missing,
empty or malformed source in well under a second, before it starts Ray. It stops at the first usable document and
reuses the load's listing (`flexorch.data.listing`), JSONL line parser and errors (`flexorch.data.source_records`),
so it says what the load would say."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from flexorch.data.errors import DataError
from flexorch.data.listing import list_source
from flexorch.data.record_kinds import kind_fields, resolve_kind
from flexorch.data.source_records import bad_record_error, check_parquet_field, parse_line, parse_record
from flexorch.data.store.layout import is_store, read_manifest

if TYPE_CHECKING:
    from flexorch.config.data import CorpusConfig

__all__ = ["CHECK_BYTES", "CHECK_FILES", "check_source"]


CHECK_FILES = 64
"""`check_source` looks at no more than this many files for a usable document ..."""
CHECK_BYTES = 64 << 20
"""... and reads no more than this many bytes; past either it stops without a verdict (the load decides)."""


def check_source(cfg: CorpusConfig) -> None:
    """Pre-flight check of `cfg.source` with plain file reads (no Ray): raise `DataError` if it cannot give a run
    one document; return None as soon as it finds one.

    Checks: the source exists and is not an empty file or a directory without data files (`list_source`'s errors);
    every file looked at is readable; and there is a usable document: for text, a non-empty file without NUL bytes
    whose start is UTF-8; for JSONL, a record with a non-empty string text field (with ``on_bad_record='error'``
    a malformed line met first raises the same file:line error as `load_corpus`; a file none of whose records has
    the text field raises the same error too); for Parquet, every file's schema has the text column
    (`check_parquet_field`) and some file has rows. It stops at the first usable document and gives up without a
    verdict after `CHECK_FILES` files or `CHECK_BYTES` bytes, so it takes milliseconds on large corpora; documents
    over ``max_context``, under ``min_tokens`` or the tokenizer's view of them are left to the load.
    """
    if cfg.source is not None and is_store(os.path.expanduser(cfg.source)):  # a prepared store: its manifest
        read_manifest(os.path.expanduser(cfg.source))  # a finished store of this format, or a clear error
        return
    listing = list_source(cfg)
    files = listing.files
    kind = resolve_kind(listing, cfg)  # chat, prompt/completion, tokenized: their first field must be there
    fields = kind_fields(kind, cfg)
    if listing.fmt == "hf_dataset":
        import pyarrow as pa

        with pa.memory_map(files[0]) as src:
            names = pa.ipc.open_stream(src).schema.names
        if fields[0] not in names:
            raise DataError(f"{files[0]} has no column {fields[0]!r} (columns: {', '.join(names)}); set the field")
        return
    if listing.fmt == "parquet":
        import pyarrow.parquet as pq

        check_parquet_field(files, fields[0])
        if not any(pq.read_metadata(f).num_rows for f in files):
            raise DataError(f"{listing.source} is empty: its {len(files)} Parquet file(s) have no rows")
        return
    budget, looked = CHECK_BYTES, files[:CHECK_FILES]
    for f in looked:
        try:
            with open(f, "rb") as fh:
                found, used = (
                    _check_text(fh, budget) if listing.fmt == "text" else _check_jsonl(fh, f, cfg, budget, kind)
                )
        except OSError as e:
            raise DataError(f"cannot read {f}: {e.strerror or e}") from None
        budget -= used
        if found or budget <= 0:
            return
    if len(looked) == len(files):
        what = "records with text" if listing.fmt == "jsonl" else "non-empty UTF-8 text files"
        raise DataError(
            f"no documents in {listing.source}: none of its {len(files)} {listing.fmt} file(s) holds {what} (they are "
            "empty, binary or without the text field); point source at your data"
        )


def _check_text(fh, budget: int) -> tuple[bool, int]:
    head = fh.read(min(budget, 1 << 16))
    if not head or b"\0" in head:
        return False, len(head)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:  # a character cut at the end of the head is fine
        return e.start >= len(head) - 3 and e.reason == "unexpected end of data", len(head)
    return True, len(head)


def _check_jsonl(fh, path: str, cfg: CorpusConfig, budget: int, kind: str = "text") -> tuple[bool | None, int]:
    used, records, with_field, columns = 0, 0, 0, set()
    field = kind_fields(kind, cfg)[0]
    for lineno, raw in enumerate(fh, 1):
        used += len(raw)
        if raw.strip():
            records += 1
            if kind == "text":
                text, reason, keys, vtype = parse_line(raw, field)
            else:  # the record's values are checked by the load (record_kinds.encode_record)
                text, reason, keys, vtype = parse_record(raw, kind_fields(kind, cfg))
            columns.update(keys)
            with_field += text is not None or vtype is not None
            if reason is not None and cfg.on_bad_record == "error":
                raise bad_record_error(path, lineno, reason)
            if text:
                return True, used
        if used >= budget:
            return None, used
    if records and not with_field:
        raise DataError(
            f"{path}: no record has a {field!r} field (fields seen: {', '.join(sorted(columns))}); "
            "set text_field to the field that holds the document text"
            + ("" if kind == "text" else f" (or the field setting of records = {kind!r})")
        )
    return False, used
