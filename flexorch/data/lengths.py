"""Sequence lengths from real data: a lengths file, a directory of text/code files, or a JSONL file.

Token counts are byte-level (one token per UTF-8 byte), the default tokenizer of flexorch's data stream, so a
length is what training would see without downloading a tokenizer.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import numpy as np

from flexorch.data.errors import DataError

__all__ = ["read_lengths", "bundled_lengths_path", "parse_tokens"]

TEXT_SUFFIXES = {
    ".txt",
    ".md",
    ".rst",
    ".py",
    ".c",
    ".h",
    ".cc",
    ".cpp",
    ".rs",
    ".go",
    ".java",
    ".js",
    ".ts",
    ".json",
    ".yaml",
    ".yml",
    ".toml",
    ".html",
    ".css",
    ".sh",
    ".tex",
}


def bundled_lengths_path() -> Path:
    """The 100k Wikipedia lengths shipped with flexorch (FlexSP's public release; see flexorch/data/bundled)."""
    return Path(str(resources.files("flexorch.data") / "bundled" / "wikipedia_lengths_100k.txt"))


def parse_tokens(text: str) -> int:
    """'384K' -> 393216, '1M' -> 1048576, '4096' -> 4096 (binary K/M, as context lengths are quoted)."""
    t = str(text).strip().upper()
    mult = {"K": 1024, "M": 1024 * 1024}.get(t[-1:], 1)
    num = t[:-1] if mult > 1 else t
    try:
        value = int(num) * mult
    except ValueError:
        raise ValueError(f"not a token count: {text!r} (use e.g. 4096, 32K or 1M)") from None
    if value < 1:
        raise ValueError(f"token count must be >= 1, got {text!r}")
    return value


def read_lengths(source: str | Path, *, text_field: str = "text") -> np.ndarray:
    """Lengths (int64 array) from a lengths file, a JSONL file (byte length of `text_field`), or a directory.

    Zero lengths (a ``0`` line, an empty text, an empty file) are kept here; callers drop and count them
    (`flexorch plan` says how many). A negative or non-integer line is a DataError naming the line."""
    path = Path(source)
    if not path.exists():
        raise DataError(f"{path} does not exist (give a lengths file, a .jsonl file or a directory of text files)")
    if path.is_dir():
        return _dir_lengths(path)
    if path.suffix == ".jsonl":
        return _jsonl_lengths(path, text_field)
    return _lengths_file(path)


def _lengths_file(path: Path) -> np.ndarray:
    out = []
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                s = line.strip()
                if not s or s.startswith("#"):
                    continue
                try:
                    v = int(s)
                except ValueError:
                    raise DataError(
                        f"{path}:{lineno}: expected one integer length per line, got {s[:40]!r} (line {lineno})"
                    ) from None
                if v < 0:
                    raise DataError(f"{path}:{lineno}: a length cannot be negative, got {v} (line {lineno})")
                out.append(v)
    except UnicodeDecodeError:
        raise DataError(f"{path} is not a text file of lengths (one integer per line)") from None
    if not out:
        raise DataError(f"{path} holds no lengths (one integer per line expected)")
    return np.asarray(out, dtype=np.int64)


def _jsonl_lengths(path: Path, field: str) -> np.ndarray:
    """Byte lengths of `field`; for chat, prompt/completion and tokenized records (sniffed from the first record's
    fields, ``flexorch.data.record_kinds``), the length of the document training would see with the byte tokenizer
    (chat: rendered with the built-in template; tokenized: its ids), BOS included."""
    from flexorch.config.data import CorpusConfig
    from flexorch.data.record_kinds import BadRecord, encode_record, kind_fields, sniff_kind
    from flexorch.data.tokenizer import ByteTokenizer

    out, kind, cfg = [], None, CorpusConfig(text_field=field)
    with path.open(encoding="utf-8", errors="strict") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if kind is None and isinstance(rec, dict):
                kind = "text" if field in rec else sniff_kind(rec, cfg)
            if kind not in (None, "text"):
                try:
                    values = {k: rec.get(k) for k in kind_fields(kind, cfg)} if isinstance(rec, dict) else {}
                    out.append(len(encode_record(kind, values, ByteTokenizer(), cfg)))
                except BadRecord as e:
                    raise DataError(f"{path}:{lineno}: {kind} record does not fit: {e}") from None
                continue
            if not isinstance(rec, dict) or field not in rec:
                raise DataError(f"{path}:{lineno}: no {field!r} field (choose it with --text-field)")
            if not isinstance(rec[field], str):
                raise DataError(f"{path}:{lineno}: field {field!r} must be a string")
            out.append(len(rec[field].encode("utf-8")))
    if not out:
        raise DataError(f"{path} holds no records")
    return np.asarray(out, dtype=np.int64)


def _dir_lengths(path: Path) -> np.ndarray:
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise DataError(f"{path} has no text or code files ({', '.join(sorted(TEXT_SUFFIXES))})")
    return np.asarray([p.stat().st_size for p in files], dtype=np.int64)
