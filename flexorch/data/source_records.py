"""The records of a corpus source and their text: JSONL lines parsed one by one, the text column of text and Parquet
blocks, and the errors that name a malformed record or a wrong text field.

JSONL is read as whole files (`read_binary_files`, one row per file) and split into lines here: Ray Data's JSON
reader refuses a whole file for one malformed line and cannot say which line. Each non-blank line is one record; a
malformed one (not valid JSON, not an object, a non-string text field) stops the load with a DataError naming the
file and line (`on_bad_record = "error"`, the default) or is skipped and counted as `bad_records` (`"skip"`). No Ray:
the packing tasks (`flexorch.data.readers`) and the pre-flight check (`flexorch.data.source_check`) both parse here.
"""

from __future__ import annotations

import json

from flexorch.data.errors import DataError

__all__ = [
    "bad_record_error",
    "block_records",
    "check_parquet_field",
    "column_texts",
    "is_utf8",
    "parse_line",
    "parse_record",
    "record_rows",
]


def check_parquet_field(files: list[str], field: str) -> None:
    """Raise `DataError` unless every Parquet file in `files` is readable and has the text column `field`."""
    import pyarrow.parquet as pq

    for f in files:
        try:
            names = pq.read_schema(f).names
        except Exception as e:  # noqa: BLE001
            raise DataError(f"{f} is not a readable Parquet file ({type(e).__name__}: {e})") from e
        if field not in names:
            raise DataError(f"{f} has no column {field!r} (columns: {', '.join(names)}); set text_field to the text")


_ARROW_NAMES = {"int": "int64", "float": "double", "bool": "bool", "list": "list", "dict": "struct"}
"""Python JSON value types as Arrow names them (the names the Parquet path reports)."""


def block_records(table, fmt: str, field: str, info: dict, rel_of, stop: bool, fields: tuple | None = None):
    """(path, record number in its file or -1, text bytes or None, malformed?) per record of an Arrow block.

    Malformed: a JSONL record that is not valid JSON, not an object, or whose text field is not a string.

    JSONL rows are whole files, split here into lines; `info` collects the fields seen, the malformed records
    ((relative path, line, reason), all of them) and a file whose text field never holds a string (`bad_type`).
    `stop`: return after the file in which the first malformed record was found.

    ``fields`` (chat, prompt/completion and tokenized records, ``flexorch.data.record_kinds.kind_fields``): the
    record is yielded as a dict of those fields instead of text bytes, None when it lacks the first one.
    ``hf_dataset`` rows are whole Arrow stream files, read here; their records are numbered from 0."""
    if "path" not in table.column_names:  # an empty block (an empty file can give one): no records
        return
    paths = table.column("path").to_pylist()
    if fmt == "hf_dataset":
        import pyarrow as pa

        for path, data in zip(paths, table.column("bytes").to_pylist(), strict=True):
            rows = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
            info["columns"].update(rows.column_names)
            values = record_rows(rows, fields) if fields else column_texts(rows, "parquet", field)[0]
            yield from ((path, r, v, False) for r, v in enumerate(values))
        return
    if fields is not None and fmt != "jsonl":
        yield from ((p, -1, v, False) for p, v in zip(paths, record_rows(table, fields), strict=True))
        return
    if fmt != "jsonl":
        datas, info["bad_type"] = column_texts(table, fmt, field)
        yield from ((p, -1, d, False) for p, d in zip(paths, datas, strict=True))
        return
    for path, data in zip(paths, table.column("bytes").to_pylist(), strict=True):
        row, n_str, first_type = 0, 0, None
        for lineno, raw in enumerate((data or b"").split(b"\n"), 1):
            if not raw.strip():
                continue  # blank lines are not records
            if fields is not None:
                text, reason, keys, vtype = parse_record(raw, fields)
            else:
                text, reason, keys, vtype = parse_line(raw, field)
            info["columns"].update(keys)
            if reason is not None:
                info["bad"].append((rel_of(path), lineno, reason))
            first_type = first_type or vtype
            n_str += text is not None
            yield path, row, text, reason is not None
            row += 1
        if first_type and not n_str and info["bad_type"] is None:  # the text field is never a string: wrong field
            info["bad_type"], info["bad_type_in"] = _ARROW_NAMES.get(first_type, first_type), rel_of(path)
        if stop and info["bad"]:
            return


def parse_line(raw: bytes, field: str) -> tuple[bytes | None, str | None, tuple, str | None]:
    """One JSONL line -> (text as UTF-8 bytes, or None for a null/missing field; why it is malformed, or None;
    the record's field names; the JSON type of a text field that is not a string, or None)."""
    try:
        obj = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8
        if isinstance(e, json.JSONDecodeError):
            return None, f"not valid JSON ({e.msg} at column {e.colno})", (), None
        return None, "not valid UTF-8", (), None
    except RecursionError:
        return None, "not valid JSON (nested too deeply)", (), None
    if not isinstance(obj, dict):
        return None, f"a JSON {type(obj).__name__}, not an object", (), None
    value = obj.get(field)
    if value is None:
        return None, None, tuple(obj), None
    if not isinstance(value, str):
        kind = type(value).__name__
        return None, f"field {field!r} holds a JSON {kind}, not a string (is text_field right?)", tuple(obj), kind
    return value.encode("utf-8", "surrogatepass"), None, tuple(obj), None


def parse_record(raw: bytes, fields: tuple) -> tuple[dict | None, str | None, tuple, None]:
    """One JSONL line of a chat/prompt-completion/tokenized source -> (the dict of ``fields``, or None when the
    record lacks the first; why it is malformed, or None; the record's field names; None). The values are checked
    by ``flexorch.data.record_kinds.encode_record``."""
    try:
        obj = json.loads(raw)
    except ValueError as e:
        return None, ("not valid UTF-8" if isinstance(e, UnicodeDecodeError) else f"not valid JSON ({e})"), (), None
    except RecursionError:
        return None, "not valid JSON (nested too deeply)", (), None
    if not isinstance(obj, dict):
        return None, f"a JSON {type(obj).__name__}, not an object", (), None
    if obj.get(fields[0]) is None:
        return None, None, tuple(obj), None
    return {f: obj.get(f) for f in fields}, None, tuple(obj), None


def record_rows(table, fields: tuple) -> list[dict | None]:
    """The rows of an Arrow table as dicts of ``fields`` (a missing column: None), None where the first is null."""
    cols = {f: table.column(f).to_pylist() if f in table.column_names else [None] * table.num_rows for f in fields}
    return [None if cols[fields[0]][i] is None else {f: cols[f][i] for f in fields} for i in range(table.num_rows)]


def bad_record_error(path: str, line: int, reason: str) -> DataError:
    return DataError(
        f"{path}:{line}: malformed JSONL record (line {line}): {reason}; fix or remove that line, or set "
        '[data] on_bad_record = "skip" to skip malformed records (they are counted in the corpus stats)'
    )


def is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def column_texts(table, fmt: str, field: str) -> tuple[list[bytes | None], str | None]:
    import pyarrow as pa

    n = table.num_rows
    if fmt == "text":
        return table.column("bytes").to_pylist(), None
    if field not in table.column_names:
        return [None] * n, None
    col = table.column(field)
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return [None if s is None else s.encode("utf-8") for s in col.to_pylist()], None
    if pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type) or pa.types.is_null(col.type):
        return col.to_pylist(), None
    return [None] * n, str(col.type)
