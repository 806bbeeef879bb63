"""Where the training documents come from and how they become token sequences (``flexorch.data`` reads them).

Pure data: no Ray, so a run file can be read and checked without starting a cluster.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["BPE_VOCAB_RANGE", "FORMATS", "RECORD_KINDS", "CorpusConfig", "DataSource", "bpe_vocab"]

FORMATS = ("auto", "text", "jsonl", "parquet", "hf_dataset")
"""How the records are stored ('hf_dataset': a directory Hugging Face ``datasets`` wrote with ``save_to_disk``)."""
RECORD_KINDS = ("auto", "text", "chat", "prompt_completion", "tokenized")
"""What one record holds (``flexorch.data.record_kinds``); ``format`` takes the last three as a shorthand."""
LOSS_ON = ("answers", "all")
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
    """How the records are stored: 'auto' (by extension and contents), 'text' (one document per file), 'jsonl' or
    'parquet' (one per record), 'hf_dataset' (a ``datasets`` ``save_to_disk`` directory: one per row). 'chat',
    'prompt_completion' and 'tokenized' are accepted here too: they set ``records`` and leave the storage 'auto'."""
    records: str = "auto"
    """What a JSONL/Parquet/``hf_dataset`` record holds (``flexorch.data.record_kinds``):

    - 'text': ``text_field`` is a document; every token carries loss;
    - 'chat': ``messages_field`` is a list of ``{role, content}`` turns, rendered with the tokenizer's own chat
      template (a ChatML-style built-in one for tokenizers without one); loss on the assistant turns only
      (``loss_on = "all"``: every token);
    - 'prompt_completion': ``prompt_field`` + ``completion_field`` (strings, joined as they are, EOS after the
      completion when the tokenizer has one); loss on the completion;
    - 'tokenized': ``input_ids_field`` (token ids) with ``labels_field`` (-100 where no loss) or
      ``loss_mask_field`` (1 where loss), or neither (loss on every token); the tokenizer is not used;
    - 'auto' (the default): 'chat' when the first record has ``messages_field``, else 'prompt_completion' when it
      has both prompt fields, else 'tokenized' when it has ``input_ids_field``, else 'text'.

    A record that does not fit its kind (no assistant turn, a role the template does not render, labels of
    another length than the ids, ...) is a malformed record: ``on_bad_record`` says whether it stops the load
    (naming it) or is skipped and counted."""
    text_field: str = "text"
    """JSONL/Parquet field that holds the document text."""
    messages_field: str = "messages"
    """Field of a chat record that holds its turns."""
    prompt_field: str = "prompt"
    """Field of a prompt/completion record that holds the prompt (context only, no loss)."""
    completion_field: str = "completion"
    """Field of a prompt/completion record that holds the completion (the loss)."""
    input_ids_field: str = "input_ids"
    """Field of a tokenized record that holds its token ids."""
    labels_field: str = "labels"
    """Field of a tokenized record with Transformers-style labels: the id where a token carries loss, -100 where
    not (aligned with the ids; the model shifts them)."""
    loss_mask_field: str = "loss_mask"
    """Field of a tokenized record with a 0/1 mask: 1 where a token carries loss."""
    loss_on: str = "answers"
    """'answers': only the assistant turns of a chat, the completion of a prompt/completion pair, carry loss
    (the prompts still condition them); 'all': every token."""
    split: str = "train"
    """The split read from a ``datasets`` ``DatasetDict`` directory (``dataset_dict.json``)."""
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
    """'split' into consecutive pieces of at most max_context tokens, 'drop' (counted) or 'reject' (an error).
    Data with loss masks splits only where an answer ends, so no answer is separated from its own prompt; an
    exchange (a prompt and its answer) longer than max_context drops its record (counted). A record whose every
    token carries loss (tokenized without labels, ``loss_on = "all"``) is cut like text."""
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
    """Tokens a prepare task tokenizes before it writes them to its part (its memory, not the store's layout)."""
    cache: str | None = None
    """Directory of prepared corpus stores (``flexorch.data.store``), shared by every run: a run finds the store
    of its source, tokenizer and settings there and prepares nothing when the source has not changed. None:
    ``$FLEXORCH_DATA_CACHE``, else ``~/.cache/flexorch/corpora``. On a cluster: a path every node mounts."""

    sources: tuple = ()
    """``[[data.sources]]``: a mixture of several corpora (:class:`DataSource`: ``source``, ``weight``, ``name`` and
    any record settings of its own), each global batch drawn from them in proportion to their weights, each with
    its own epochs (``flexorch.data.mixture``); ``source`` must then be unset. Empty: the one ``source``."""

    def __post_init__(self) -> None:
        self._check_sources()
        if self.format in RECORD_KINDS[2:]:  # format = "chat": a shorthand for records = "chat"
            if self.records not in ("auto", self.format):
                raise ValueError(f"format = {self.format!r} and records = {self.records!r} disagree; set one")
            object.__setattr__(self, "records", self.format)
            object.__setattr__(self, "format", "auto")
        if self.format not in FORMATS:
            kinds = RECORD_KINDS[2:]
            raise ValueError(f"format must be one of {FORMATS} (or a record kind: {kinds}), got {self.format!r}")
        if self.records not in RECORD_KINDS:
            raise ValueError(f"records must be one of {RECORD_KINDS}, got {self.records!r}")
        if self.loss_on not in LOSS_ON:
            raise ValueError(f"loss_on must be 'answers' (assistant turns, completions) or 'all', got {self.loss_on!r}")
        for name in ("messages_field", "prompt_field", "completion_field", "input_ids_field", "labels_field"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or value == "path":
                raise ValueError(f"{name} must name a record field other than 'path', got {value!r}")
        if not isinstance(self.loss_mask_field, str) or not self.loss_mask_field:
            raise ValueError(f"loss_mask_field must name a record field, got {self.loss_mask_field!r}")
        if not isinstance(self.split, str) or not self.split:
            raise ValueError(f"split must name a split of the dataset (e.g. 'train'), got {self.split!r}")
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

    def _check_sources(self) -> None:
        if not self.sources:
            object.__setattr__(self, "sources", ())
            return
        if self.source is not None:
            raise ValueError("set either [data] source or [[data.sources]] (a mixture), not both")
        srcs = tuple(s if isinstance(s, DataSource) else _data_source(s) for s in self.sources)
        names = [s.name for s in srcs]
        if len(set(names)) != len(names):
            raise ValueError(f"[[data.sources]] names must differ (set name = ...), got {names}")
        object.__setattr__(self, "sources", srcs)

    def source_config(self, i: int) -> CorpusConfig:
        """The corpus settings of mixture source ``i``: this table's, with the source's own where it sets them."""
        src = self.sources[i]
        own = {f.name: getattr(src, f.name) for f in dataclasses.fields(DataSource) if f.name not in _NOT_SETTINGS}
        own = {k: v for k, v in own.items() if v is not None}
        return dataclasses.replace(self, sources=(), source=src.source, **own)


@dataclass(frozen=True, kw_only=True)
class DataSource:
    """One corpus of a ``[[data.sources]]`` mixture; unset record settings are the ``[data]`` table's."""

    source: str
    """Its directory, JSONL or Parquet file, ``datasets`` directory, or prepared store."""
    weight: float = 1.0
    """Its share of every global batch: weight / sum of the weights (Megatron's blending rule, exact to a document)."""
    name: str = ""
    """How the records and the console name it (default: the source's file or directory name)."""
    format: str | None = None
    records: str | None = None
    text_field: str | None = None
    messages_field: str | None = None
    prompt_field: str | None = None
    completion_field: str | None = None
    input_ids_field: str | None = None
    labels_field: str | None = None
    loss_mask_field: str | None = None
    loss_on: str | None = None
    split: str | None = None
    over_long: str | None = None
    min_tokens: int | None = None
    bad_files: str | None = None
    on_bad_record: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError(f"a [[data.sources]] entry needs source = a path, got {self.source!r}")
        if not isinstance(self.weight, (int, float)) or not self.weight > 0:
            raise ValueError(f"[[data.sources]] {self.source!r}: weight must be > 0, got {self.weight!r}")
        if not self.name:
            base = self.source.rstrip("/").rsplit("/", 1)[-1] or self.source
            object.__setattr__(self, "name", base)


_NOT_SETTINGS = ("source", "weight", "name")


def _data_source(value) -> DataSource:
    if not isinstance(value, dict):
        raise ValueError(f"[[data.sources]] entries are tables (source = ..., weight = ...), got {value!r}")
    known = {f.name for f in dataclasses.fields(DataSource)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"[[data.sources]]: unknown keys {unknown}; known: {sorted(known)}")
    return DataSource(**value)
