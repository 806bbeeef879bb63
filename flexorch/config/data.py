"""Where the training documents come from and how they become token sequences (``flexorch.data`` reads them).

Pure data: no Ray, so a run file can be read and checked without starting a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FORMATS", "CorpusConfig"]

FORMATS = ("auto", "text", "jsonl", "parquet")


@dataclass(frozen=True, kw_only=True)
class CorpusConfig:
    """Where the training documents come from and how they become token sequences."""

    source: str | None = None
    """Directory of text/code files, JSONL file/directory, or Parquet file/directory; None: the stdlib's .py files."""
    format: str = "auto"
    """'auto' (by extension and contents), 'text' (one document per file), 'jsonl' or 'parquet' (one per record)."""
    text_field: str = "text"
    """JSONL/Parquet field that holds the document text."""
    tokenizer: str = "byte"
    """'byte' (ids 0..255 plus BOS 256, no download) or 'hf:<name_or_path>' (needs transformers)."""
    max_context: int = 2048
    """Longest document, in tokens; longer ones are handled by `over_long`."""
    over_long: str = "split"
    """'split' into consecutive pieces of at most max_context tokens, 'drop' (counted) or 'reject' (an error)."""
    bad_files: str = "skip"
    """Binary/undecodable files and records without text: 'skip' (counted in stats) or 'error'."""
    min_tokens: int = 2
    """Documents (and pieces) with fewer tokens than this, BOS included, are skipped and counted."""
    extensions: tuple[str, ...] | None = None
    """Only read directory files with these suffixes (e.g. ('.py', '.md')); None: every non-hidden file."""
    block_tokens: int = 1 << 20
    """Target tokens per object-store block (int32: 4 MiB by default); a longer document gets a block of its own."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {self.format!r}")
        if self.over_long not in ("split", "drop", "reject"):
            raise ValueError(f"over_long must be 'split', 'drop' or 'reject', got {self.over_long!r}")
        if self.bad_files not in ("skip", "error"):
            raise ValueError(f"bad_files must be 'skip' or 'error', got {self.bad_files!r}")
        if self.min_tokens < 1 or self.max_context < self.min_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_context, got {self.min_tokens} and {self.max_context}")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if self.source is not None:
            if not str(self.source).strip():
                raise ValueError("source must be a path (or None for the default stdlib corpus), got ''")
            object.__setattr__(self, "source", str(self.source))
        if not self.text_field or self.text_field == "path":
            raise ValueError(
                f"text_field must name a field other than 'path' (Ray Data's file column), got {self.text_field!r}"
            )
        if not (self.tokenizer == "byte" or (self.tokenizer.startswith("hf:") and len(self.tokenizer) > 3)):
            raise ValueError(f"tokenizer must be 'byte' or 'hf:<name_or_path>', got {self.tokenizer!r}")
        if self.extensions is not None:
            if isinstance(self.extensions, str) or not self.extensions:
                raise ValueError(f"extensions must be a non-empty tuple like ('.py', '.md'), got {self.extensions!r}")
            norm = tuple(e.lower() if e.startswith(".") else "." + e.lower() for e in self.extensions)
            object.__setattr__(self, "extensions", norm)
