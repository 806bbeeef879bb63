"""A tokenized training corpus whose tokens live in the Ray object store; the driver keeps only the index.

Sources: a directory of text/code files (one document per file), JSONL (one per non-blank line) or Parquet (one
per row), read with Ray Data readers (`read_binary_files` for text and JSONL files, whose lines `flexorch` parses
itself so a malformed line is named by file and line, or skipped with ``on_bad_record = "skip"``; `read_parquet`).
Default: the Python standard library's own `.py` files, real text on every machine, no download. An empty file or
a source without records is a `DataError`; `flexorch.data.source_check.check_source` checks a source without Ray.

Document keys: `relative/path.py` (a file), `file.jsonl:N` (N = 1-based record number; blank lines are not
records), `file.parquet:N` (0-based row), and `<key>#pieceK` (K = 0, 1, ...) for the pieces of a document longer
than `max_context` that was split (only piece 0 starts with BOS; the pieces concatenate back to the document).
Document ids are 0..n-1 in key order (pieces in order). `Corpus.stats` counts everything that was not kept:
`files`, `records`, `documents`, `tokens`, `blocks`, `skipped_binary` (NUL bytes or invalid UTF-8),
`skipped_empty` (empty, a zero-length JSONL/Parquet text, or fewer than `min_tokens` tokens), `skipped_no_text`
(JSONL/Parquet null or missing text), `bad_records` (malformed JSONL lines skipped with ``on_bad_record =
"skip"``), `dropped_over_long`, `split_docs`, `pieces_added` (pieces kept from split documents),
`dropped_short_pieces`, `skipped_hidden` (names starting with "."), `skipped_extension`, and up to 5 example keys
per reason (`examples`); `documents = records - skipped_* - bad_records - dropped_over_long - split_docs +
pieces_added`.

Loading: `load_corpus` lists the source, reads it with Ray Data (quietly: no progress bars, execution banners
or stats logs), tokenizes and packs it into `int32` blocks in the object store with one Ray task per Arrow
block, and keeps only the index (keys, lengths, block and offset per document) on the driver; the steps and the
reasons for them are in `flexorch.data.readers`. With a ``publish`` callable it reports what it is doing as
``{"event": "progress", "message": ...}`` events: each phase as it starts, and every ``PROGRESS_EVERY_S`` while one
runs (a background thread only publishes; the phases run unchanged on the calling thread).

On a worker: a Ray task or actor that receives the dict from `Corpus.refs_for` gets the ObjectRefs themselves
(Ray resolves only top-level arguments), so it calls `resolve_blocks(refs)` (one `ray.get`) and then
`fetch_documents(blocks, locations)`. The returned arrays are read-only views of the shared blocks. The process
that called `load_corpus` owns the blocks: they live while it holds the `Corpus` (and die with that process).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import numpy as np
import ray

from flexorch.config.data import CorpusConfig
from flexorch.data import readers as corpus_io
from flexorch.data.record_kinds import resolve_kind
from flexorch.data.targets import token_ids
from flexorch.data.tokenizer import get_tokenizer
from flexorch.tasks.step import DocRef

__all__ = ["Corpus", "load_corpus", "fetch_documents", "resolve_blocks"]

PROGRESS_EVERY_S = 10.0


class Corpus:
    """The index of a loaded corpus (keys, lengths, locations) plus refs to its token blocks in the object store."""

    def __init__(
        self,
        *,
        keys,
        lengths,
        doc_blocks,
        doc_offsets,
        block_refs,
        stats,
        tokenizer_name,
        vocab_size,
        targets=None,
        task_of=None,
        task_names=(),
    ):
        self.keys: list[str] = keys
        self.lengths: np.ndarray = lengths
        self.targets: np.ndarray | None = targets
        """Tokens that carry loss per document (chat, prompt/completion, tokenized records); None: plain text,
        every token after the first."""
        self.doc_blocks: np.ndarray = doc_blocks
        self.doc_offsets: np.ndarray = doc_offsets
        self.block_refs: list[ray.ObjectRef] = block_refs
        self.stats: dict = stats
        self.tokenizer_name: str = tokenizer_name
        self.vocab_size: int = vocab_size
        self.task_of: np.ndarray | None = task_of
        """The ``[[tasks]]`` task of each document (``flexorch.data.task_corpus``); None: one task."""
        self.task_names: tuple[str, ...] = tuple(task_names)

    @property
    def num_docs(self) -> int:
        return len(self.keys)

    def locate(self, doc_ids) -> list[DocRef]:
        """Block, offset and length of each document id (``block_refs[block][offset : offset + length]``)."""
        ids = np.asarray(doc_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_docs):
            bad = int(ids[(ids < 0) | (ids >= self.num_docs)][0])
            raise IndexError(f"document id {bad} is out of range: the corpus has ids 0..{self.num_docs - 1}")
        b, o, n = self.doc_blocks[ids], self.doc_offsets[ids], self.lengths[ids]
        t = [None] * len(ids) if self.targets is None else [int(x) for x in self.targets[ids]]
        k = [0] * len(ids) if self.task_of is None else [int(x) for x in self.task_of[ids]]
        return [
            DocRef(int(i), int(bi), int(oi), int(ni), ti, ki)
            for i, bi, oi, ni, ti, ki in zip(ids, b, o, n, t, k, strict=True)
        ]

    def refs_for(self, locations) -> dict[int, ray.ObjectRef]:
        """The object refs of just the blocks these documents live in, by block index."""
        return {blk: self.block_refs[blk] for blk in sorted({loc.block for loc in locations})}

    def get_tokens(self, doc_ids) -> list[np.ndarray]:
        """Driver-side convenience (tests, references): the token ids of `doc_ids`, copied out of the store."""
        return [token_ids(t) for t in self.get_stored(doc_ids)]

    def get_stored(self, doc_ids) -> list[np.ndarray]:
        """The documents as stored, loss mask included (``flexorch.data.targets``: a token that carries no loss is
        ``~id``); plain text: the ids. What a single-process reference needs to compute the run's loss."""
        locs = self.locate(doc_ids)
        return [t.copy() for t in fetch_documents(resolve_blocks(self.refs_for(locs)), locs)]

    def __repr__(self) -> str:
        return (
            f"Corpus({self.num_docs} docs, {int(self.lengths.sum())} tokens, {len(self.block_refs)} blocks, "
            f"tokenizer {self.tokenizer_name!r}, source {self.stats.get('source')!r})"
        )


def resolve_blocks(refs: dict[int, ray.ObjectRef]) -> dict[int, np.ndarray]:
    """`ray.get` the refs of a `refs_for` dict (Ray does not resolve refs nested in a dict argument)."""
    keys = list(refs)
    return dict(zip(keys, ray.get([refs[k] for k in keys]), strict=True))


def fetch_documents(blocks: dict[int, np.ndarray], locations) -> list[np.ndarray]:
    """Token arrays of `locations` from resolved blocks (read-only views; copy to keep them past the blocks)."""
    out = []
    for loc in locations:
        if loc.block not in blocks:
            raise KeyError(f"block {loc.block} of document {loc.doc_id} was not passed; use corpus.refs_for(locations)")
        out.append(blocks[loc.block][loc.offset : loc.offset + loc.length])
    return out


def load_corpus(cfg: CorpusConfig, publish=None) -> Corpus:
    """Read, tokenize and index `cfg.source` with Ray Data and Ray tasks; needs `ray.init()` to have run.

    The reads and packing tasks need free CPUs: load the corpus before starting actors that reserve every CPU.
    Ray Data runs quietly (no progress bars, execution banners or stats logs; see `flexorch.data.readers`).
    ``publish``: gets progress events (see the module doc); None: nothing is reported.
    """
    if not ray.is_initialized():
        raise RuntimeError("load_corpus needs a Ray cluster: call ray.init() (or connect to one) first")
    if not ray.cluster_resources().get("CPU"):
        raise RuntimeError("the Ray cluster has no CPUs; load_corpus runs Ray Data reads and Ray tasks on CPUs")
    t0 = time.perf_counter()
    with progress_phases(publish, "loading the corpus") as phase:
        phase("listing the source")
        listing = corpus_io.list_source(cfg)
        kind = resolve_kind(listing, cfg)
        if kind != "tokenized":
            phase(f"loading tokenizer {cfg.tokenizer!r}")
            tok = get_tokenizer(cfg.tokenizer)
        what = "" if kind == "text" else f" ({kind} records)"
        phase(f"reading {len(listing.files)} {listing.fmt} files{what} under {listing.source}")
        arrow_refs = corpus_io.read_source(listing, cfg, kind)
        phase(f"tokenizing and packing {len(arrow_refs)} blocks")
        block_refs, metas = corpus_io.pack_blocks(arrow_refs, listing, cfg, kind)
        del arrow_refs  # the packed blocks replace the raw Arrow blocks in the object store
        phase("indexing")
        name = "pre-tokenized" if kind == "tokenized" else tok.name
        index = corpus_io.assemble_index(cfg, listing, metas, block_refs, name, kind)
    index["stats"]["load_s"] = round(time.perf_counter() - t0, 3)
    if publish is not None:
        n, tokens = len(index["keys"]), int(index["lengths"].sum())
        msg = f"loaded the corpus: {n:,} documents, {tokens:,} tokens in {time.perf_counter() - t0:.0f} s"
        publish({"event": "progress", "message": msg})
    vocab = index["stats"]["max_token_id"] + 1 if kind == "tokenized" else tok.vocab_size
    return Corpus(**index, tokenizer_name=name, vocab_size=vocab)


@contextmanager
def progress_phases(publish, task: str, every_s: float = PROGRESS_EVERY_S):
    """Yields ``phase(what)``: publishes ``"<task>: <what>"`` now, and ``"<task>: <what> (N s so far)"`` every
    ``every_s`` until the next phase or the end (a daemon thread that only publishes). ``publish`` None: silent."""
    if publish is None:
        yield lambda what: None
        return
    current = {"what": "", "started": time.monotonic(), "told": time.monotonic()}
    stop = threading.Event()

    def phase(what: str) -> None:
        now = time.monotonic()
        current.update(what=what, started=now, told=now)
        publish({"event": "progress", "message": f"{task}: {what}"})

    def ticker() -> None:
        while not stop.wait(1.0):
            now = time.monotonic()
            if now - current["told"] >= every_s:
                current["told"] = now
                msg = f"{task}: {current['what']} ({now - current['started']:.0f} s so far)"
                publish({"event": "progress", "message": msg})

    thread = threading.Thread(target=ticker, name="flexorch-progress", daemon=True)
    thread.start()
    try:
        yield phase
    finally:
        stop.set()
        thread.join()
