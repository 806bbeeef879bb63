"""Where the training documents come from and how they become token sequences (``flexorch.data`` reads them).

Pure data: no Ray, so a run file can be read and checked without starting a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BPE_VOCAB_RANGE", "FORMATS", "CorpusConfig", "bpe_vocab"]

FORMATS = ("auto", "text", "jsonl", "parquet")
BPE_VOCAB_RANGE = (260, 1_000_000)
"""The vocabulary sizes ``'bpe:<N>'`` takes: the 256 bytes, ``<s>`` and a few merges, up to a million ids."""
TOKENIZER_SPECS = "'auto' (the default), 'byte', 'hf:<local tokenizer dir>' or 'bpe:<N>' (e.g. 'bpe:2048')"


def bpe_vocab(spec: str) -> int | None:
    """N of a ``'bpe:<N>'`` tokenizer spec, None for any other spec (a malformed 'bpe:' spec raises ValueError)."""
    if not isinstance(spec, str) or not spec.startswith("bpe:"):
        return None
    n = spec[4:]
    lo, hi = BPE_VOCAB_RANGE
    if not (n.isascii() and n.isdigit()) or not lo <= int(n) <= hi:
        raise ValueError(
            f"tokenizer {spec!r}: 'bpe:<N>' needs an integer vocabulary size N with {lo} <= N <= {hi:_} "
            "(e.g. 'bpe:2048'), no larger than model.vocab_size"
        )
    return int(n)


@dataclass(frozen=True, kw_only=True)
class CorpusConfig:
    """Where the training documents come from and how they become token sequences."""

    source: str | None = None
    """Directory of text/code files, JSONL file/directory, or Parquet file/directory; None: the stdlib's .py files."""
    format: str = "auto"
    """'auto' (by extension and contents), 'text' (one document per file), 'jsonl' or 'parquet' (one per record)."""
    text_field: str = "text"
    """JSONL/Parquet field that holds the document text."""
    tokenizer: str = "auto"
    """How documents become token ids; nothing is ever downloaded:

    - 'auto' (the default): 'byte' for flexorch's own decoder; for a Hugging Face model (``[model] hf = DIR``) the
      model directory's own tokenizer ('hf:DIR'), an error when DIR has none (``TrainConfig`` resolves it; outside
      a run, e.g. ``load_corpus`` on this table alone, it is 'byte');
    - 'byte': ids 0..255 are the UTF-8 bytes, BOS is 256 (257 ids);
    - 'hf:<dir>': a local tokenizer directory (``save_pretrained``), loaded with Transformers'
      ``AutoTokenizer.from_pretrained(dir, local_files_only=True)``; a Hub id must be fetched first
      (``hf download org/name --local-dir DIR``);
    - 'bpe:<N>': a byte-level BPE of N ids (``<s>`` = 0 is the BOS) trained in seconds on the first ~8 MB of this
      corpus at the start of the run and saved in ``<run_dir>/tokenizer`` (a resumed run reuses it); the run
      then records 'hf:<run_dir>/tokenizer' (``flexorch.data.bpe``)."""
    max_context: int = 2048
    """Longest document, in tokens; longer ones are handled by `over_long`."""
    over_long: str = "split"
    """'split' into consecutive pieces of at most max_context tokens, 'drop' (counted) or 'reject' (an error)."""
    bad_files: str = "skip"
    """Binary/undecodable files and records without text (a null or missing text field): 'skip' (counted in
    stats) or 'error'."""
    on_bad_record: str = "error"
    """Malformed JSONL lines (not valid JSON, not a JSON object, or a text field that is not a string): 'error'
    (a DataError naming the file and line) or 'skip' (skipped and counted in stats as ``bad_records``)."""
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
        if self.on_bad_record not in ("error", "skip"):
            raise ValueError(
                f"on_bad_record must be 'error' (stop at the first malformed JSONL record) or 'skip' (skip and "
                f"count malformed records), got {self.on_bad_record!r}"
            )
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
        tok = self.tokenizer
        if not isinstance(tok, str) or not (
            tok in ("auto", "byte") or (tok.startswith("hf:") and tok[3:].strip()) or bpe_vocab(tok) is not None
        ):
            raise ValueError(f"tokenizer must be {TOKENIZER_SPECS}, got {tok!r}")
        if self.extensions is not None:
            if isinstance(self.extensions, str) or not self.extensions:
                raise ValueError(f"extensions must be a non-empty tuple like ('.py', '.md'), got {self.extensions!r}")
            norm = tuple(e.lower() if e.startswith(".") else "." + e.lower() for e in self.extensions)
            object.__setattr__(self, "extensions", norm)
