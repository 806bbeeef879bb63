"""A tokenized training corpus: a prepared store on disk (``flexorch.data.store``) whose index the driver keeps
by memory map; the tokens stay in the store's blocks and workers read their own documents.

Sources: a directory of text/code files (one document per file), JSONL (one per non-blank line), Parquet (one per
row), a ``datasets`` ``save_to_disk`` directory, or a store ``flexorch prepare`` wrote. Default: the Python
standard library's own `.py` files, real text on every machine, no download. An empty file or a source without
records is a `DataError`; `flexorch.data.source_check.check_source` checks a source without Ray.

Document keys: `relative/path.py` (a file), `file.jsonl:N` (N = 1-based record number; blank lines are not
records), `file.parquet:N` (0-based row), and `<key>#pieceK` (K = 0, 1, ...) for the pieces of a document longer
than `max_context` that was split (only piece 0 starts with BOS; the pieces concatenate back to the document).
Document ids are 0..n-1 in key order (pieces in order); keys are formatted on demand (``flexorch.data.doc_keys``).
`Corpus.stats` counts everything that was not kept:
`files`, `records`, `documents`, `tokens`, `skipped_binary` (NUL bytes or invalid UTF-8),
`skipped_empty` (empty, a zero-length JSONL/Parquet text, or fewer than `min_tokens` tokens), `skipped_no_text`
(JSONL/Parquet null or missing text), `bad_records` (malformed JSONL lines skipped with ``on_bad_record =
"skip"``), `dropped_over_long`, `split_docs`, `pieces_added` (pieces kept from split documents),
`dropped_short_pieces`, `skipped_hidden` (names starting with "."), `skipped_extension`, and up to 5 example keys
per reason (`examples`); `documents = records - skipped_* - bad_records - dropped_over_long - split_docs +
pieces_added`.

Loading: `load_corpus` finds the source's store in ``[data] cache`` by its fingerprints (source files, tokenizer,
settings: ``flexorch.data.store.fingerprint``) and opens it in milliseconds; a source never prepared, changed since,
or a store with a damaged block is prepared (again) first, in parallel over the cluster
(``flexorch.data.store.prepare``). With a ``publish`` callable it reports what it is doing as
``{"event": "progress", "message": ...}`` events: each phase as it starts, and every ``PROGRESS_EVERY_S`` while one
runs (a background thread only publishes; the phases run unchanged on the calling thread).

On a worker: a Ray task or actor that receives the ``{block: BlockSpec}`` dict from `Corpus.block_specs` calls
``flexorch.data.store.blocks.open_blocks(specs)`` (it opens each block once per process) and then
``fetch_documents(blocks, locations)`` (same module).
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from flexorch.config.data import CorpusConfig
from flexorch.data.doc_keys import DocKeys, ListKeys
from flexorch.data.errors import DataError
from flexorch.data.targets import token_ids
from flexorch.work.step import DocRef

__all__ = ["Corpus", "default_cache_dir", "load_corpus", "open_store"]

PROGRESS_EVERY_S = 10.0
CACHE_ENV = "FLEXORCH_DATA_CACHE"


class Corpus:
    """The index of a corpus (keys, lengths, locations; arrays that may be memory-mapped) plus its blocks' specs."""

    def __init__(
        self,
        *,
        keys,
        lengths,
        doc_blocks,
        doc_offsets,
        blocks,
        stats,
        tokenizer_name,
        vocab_size,
        targets=None,
        task_of=None,
        task_names=(),
        store=None,
    ):
        self.keys: DocKeys = keys if isinstance(keys, DocKeys) else ListKeys(keys)
        self.lengths: np.ndarray = lengths
        self.targets: np.ndarray | None = targets
        """Tokens that carry loss per document (chat, prompt/completion, tokenized records); None: plain text,
        every token after the first."""
        self.doc_blocks: np.ndarray = doc_blocks
        """The block (index into ``blocks``) each document lives in."""
        self.doc_offsets: np.ndarray = doc_offsets
        self.blocks: list = list(blocks)
        """``flexorch.data.store.blocks.BlockSpec`` per block (an in-memory corpus: the token arrays themselves)."""
        self.stats: dict = stats
        self.tokenizer_name: str = tokenizer_name
        self.vocab_size: int = vocab_size
        self.task_of: np.ndarray | None = task_of
        """The ``[[tasks]]`` task of each document (``flexorch.data.task_corpus``); None: one task."""
        self.task_names: tuple[str, ...] = tuple(task_names)
        self.store: str | None = store
        """The store directory this corpus was opened from (None: combined in memory)."""
        self.manifest: dict | None = None
        """The store's manifest (opened from a store)."""
        self.mixture: tuple | None = None
        """``[[data.sources]]``: (names, documents, weights) of the sources (``flexorch.data.mixture``)."""

    @property
    def num_docs(self) -> int:
        return len(self.lengths)

    @property
    def total_tokens(self) -> int:
        """Tokens in the corpus (from the stats: no pass over the lengths)."""
        return int(self.stats["tokens"]) if "tokens" in self.stats else int(np.asarray(self.lengths).sum())

    def locate(self, doc_ids) -> list[DocRef]:
        """Block, offset and length of each document id (``blocks[block]``, tokens ``offset : offset + length``)."""
        ids = np.asarray(doc_ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_docs):
            bad = int(ids[(ids < 0) | (ids >= self.num_docs)][0])
            raise IndexError(f"document id {bad} is out of range: the corpus has ids 0..{self.num_docs - 1}")
        # whole arrays to Python ints at once: a conversion per value is slow for a batch of thousands
        b, o, n = self.doc_blocks[ids].tolist(), self.doc_offsets[ids].tolist(), self.lengths[ids].tolist()
        t = [None] * len(ids) if self.targets is None else self.targets[ids].tolist()
        k = [0] * len(ids) if self.task_of is None else self.task_of[ids].tolist()
        return [DocRef(*fields) for fields in zip(ids.tolist(), b, o, n, t, k, strict=True)]

    def block_specs(self, blocks) -> dict:
        """The specs of just these blocks (indices, e.g. ``{loc.block for loc in locations}`` or a rank's
        ``StepWork.blocks()``), by block index in order: what a worker opens to read its documents."""
        return {b: self.blocks[b] for b in sorted(set(blocks))}

    def block_specs_each(self, block_sets) -> list[dict]:
        """:meth:`block_specs` of each set of blocks (e.g. each rank's ``StepWork.blocks()``); equal sets (the
        members of a group read the same blocks) share one dict, looked up once."""
        specs: dict[frozenset, dict] = {}
        out = []
        for blocks in block_sets:
            key = frozenset(blocks)
            if key not in specs:
                specs[key] = self.block_specs(key)
            out.append(specs[key])
        return out

    def get_tokens(self, doc_ids) -> list[np.ndarray]:
        """Driver-side convenience (tests, references): the token ids of `doc_ids`, copied out of the store."""
        return [token_ids(t) for t in self.get_stored(doc_ids)]

    def get_stored(self, doc_ids) -> list[np.ndarray]:
        """The documents as stored, loss mask included (``flexorch.data.targets``: a token that carries no loss is
        ``~id``); plain text: the ids. What a single-process reference needs to compute the run's loss."""
        from flexorch.data.store.blocks import fetch_documents, open_blocks

        locs = self.locate(doc_ids)
        blocks = open_blocks(self.block_specs(loc.block for loc in locs))
        return [np.array(t, dtype=np.int32) for t in fetch_documents(blocks, locs)]

    def __repr__(self) -> str:
        return (
            f"Corpus({self.num_docs} docs, {self.total_tokens} tokens, {len(self.blocks)} blocks, "
            f"tokenizer {self.tokenizer_name!r}, source {self.stats.get('source')!r})"
        )


def default_cache_dir() -> str:
    """``$FLEXORCH_DATA_CACHE``, else ``$XDG_CACHE_HOME/flexorch/corpora`` (``~/.cache/flexorch/corpora``)."""
    if os.environ.get(CACHE_ENV):
        return os.path.expanduser(os.environ[CACHE_ENV])
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "flexorch", "corpora")


def open_store(store: str | Path) -> Corpus:
    """The corpus of a finished store: its index arrays memory-mapped, nothing read per document. ``store``: a
    directory, or an ``s3://``/``gs://`` URI (its manifest and index are fetched once into a local cache, its blocks
    read by range: ``flexorch.data.store.remote``)."""
    from flexorch.data.store import remote
    from flexorch.data.store.blocks import BlockSpec

    where, manifest, local, block = _store_files(store)

    def arr(name: str):
        return np.load(local("index", f"{name}.npy"), mmap_mode="r")

    def has_targets() -> bool:  # a manifest without its "index" list (an older store layout)
        if "index" in manifest:
            return False
        return (
            remote.exists(remote.join(where, "index", "targets.npy"))
            if remote.is_remote(where)
            else Path(where, "index", "targets.npy").is_file()
        )

    names = json.loads(Path(local("index", "key_names.json")).read_text())
    keys = DocKeys(names["names"], names["fmt"], arr("key_path"), arr("key_row"), arr("key_piece"))
    # "parts" and the index's "part" array: the store format's names for its blocks
    blocks = [BlockSpec(block(p["file"]), block(p["sums"]), manifest["dtype"], p["tokens"]) for p in manifest["parts"]]
    stats = dict(manifest["stats"])
    stats["store"] = where
    corpus = Corpus(
        keys=keys,
        lengths=arr("lengths"),
        targets=arr("targets") if "targets" in manifest.get("index", ()) or has_targets() else None,
        doc_blocks=arr("part"),
        doc_offsets=arr("offset"),
        blocks=blocks,
        stats=stats,
        tokenizer_name=manifest["tokenizer_name"],
        vocab_size=int(manifest["vocab_size"]),
        store=where,
    )
    corpus.manifest = manifest
    return corpus


def _store_files(store: str | Path):
    """A finished store's location, its manifest, and where to read its small files (``local(*rel)``: a local path,
    fetched once for a remote store) and its blocks (``block(name)``); a local store with a damaged block is an
    error."""
    from flexorch.data.store import layout, remote
    from flexorch.data.store.prepare import damaged_blocks

    if remote.is_remote(str(store)):
        where = str(store).rstrip("/")
        manifest = layout.check_manifest(
            json.loads(Path(remote.fetch_small(remote.join(where, "manifest.json"))).read_text()), where
        )

        def local(*rel: str) -> str:
            return remote.fetch_small(remote.join(where, *rel))

        def block(name: str) -> str:
            return remote.join(where, "parts", name)  # "parts/": the store format's directory of blocks
    else:
        root = Path(os.path.abspath(Path(store).expanduser()))
        where, manifest = str(root), layout.read_manifest(root)
        bad = damaged_blocks(root, manifest)
        if bad:
            raise DataError(
                f"corpus store {root} is damaged: {'; '.join(bad[:3])}; run `flexorch prepare` on its source again "
                "(it redoes only the damaged blocks), or remove the store to prepare it anew"
            )

        def local(*rel: str) -> str:
            return str(root.joinpath(*rel))

        def block(name: str) -> str:
            return str(root / "parts" / name)

    return where, manifest, local, block


def load_corpus(cfg: CorpusConfig, publish=None, *, parallelism: int | None = None) -> Corpus:
    """The corpus of ``cfg.source``: its store in ``cfg.cache`` (default: :func:`default_cache_dir`) opened as it is
    when its fingerprints match, else prepared (again) first. A ``source`` that is itself a prepared store is
    opened directly. Preparing runs Ray tasks over the cluster (``ray.init()`` is called when Ray is not running);
    ``parallelism`` as in ``flexorch.data.store.prepare.prepare_store``. ``publish``: gets progress events (see the
    module doc); None: nothing is reported."""
    from flexorch.data.listing import list_source
    from flexorch.data.record_kinds import resolve_kind
    from flexorch.data.store import layout
    from flexorch.data.store.fingerprint import describe_change, fingerprints, same_fingerprints
    from flexorch.data.store.prepare import prepare_store

    t0 = time.perf_counter()
    from flexorch.data.store.remote import is_remote

    if cfg.source is not None and (is_remote(cfg.source) or layout.is_store(os.path.expanduser(cfg.source))):
        corpus = open_store(cfg.source)
        _check_store_fits(corpus, cfg)
        return _opened(corpus, t0, publish, "opened the prepared corpus")
    with progress_phases(publish, "loading the corpus") as phase:
        phase("listing the source")
        listing = list_source(cfg)
        kind = resolve_kind(listing, cfg)
        fp = fingerprints(cfg, listing, kind)
        store = Path(cfg.cache or default_cache_dir()).expanduser() / fp["key"]
        ready = False
        if (store / "manifest.json").is_file():
            try:
                old = layout.read_manifest(store)
            except DataError:
                old = None
            if old is not None and same_fingerprints(old["fingerprints"], fp):
                try:
                    return _opened(_as_run(open_store(store), fp), t0, publish, "opened the corpus store")
                except DataError as e:
                    phase(f"{e}; preparing the damaged blocks again")
            elif old is not None:
                change = describe_change(old["fingerprints"], fp, *_file_lists(store, listing))
                phase(f"the corpus store {store} is out of date ({change}); preparing it again")
        if not ready:
            _say_other_stores(store, fp, phase)
            phase(f"preparing {len(listing.files)} {listing.fmt} files under {listing.source}")
            prepare_store(cfg, store, publish, listing=listing, kind=kind, parallelism=parallelism)
    return _opened(_as_run(open_store(store), fp), t0, publish, "loaded the corpus")


def _as_run(corpus: Corpus, fp: dict) -> Corpus:
    """The corpus named by this run's tokenizer spec (a store is shared by runs whose tokenizers have the same
    files, e.g. the same BPE saved in each run's directory)."""
    if fp["tokenizer"] != "pre-tokenized":
        corpus.tokenizer_name = fp["tokenizer"]
    return corpus


def _file_lists(store: Path, listing) -> tuple[list | None, list | None]:
    """The source files a store was prepared from (its plan) and the listed ones now, to name what changed."""
    from flexorch.data.store.fingerprint import source_files

    try:
        return json.loads((store / "plan.json").read_text())["source_files"], source_files(listing)
    except (OSError, ValueError, KeyError):
        return None, None


def _check_store_fits(corpus: Corpus, cfg: CorpusConfig) -> None:
    """A store given as the source must suit the run: no document over the run's ``max_context``, and the run's
    tokenizer (when it names one) the store's."""
    from flexorch.data.store.fingerprint import tokenizer_fingerprint

    st, fp = corpus.stats, corpus.manifest["fingerprints"]
    if int(st.get("max_doc_tokens", 0)) > cfg.max_context:
        raise DataError(
            f"the store {corpus.store} holds documents of up to {st['max_doc_tokens']} tokens (prepared with "
            f"max_context={st.get('max_context')}), over this run's max_context={cfg.max_context}: set [data] "
            f"max_context = {st.get('max_context')}, or prepare the store again with --max-context {cfg.max_context}"
        )
    tok = cfg.tokenizer
    if (
        fp.get("tokenizer") != "pre-tokenized"
        and tok not in ("auto",)
        and (tokenizer_fingerprint(tok) != fp.get("tokenizer_digest"))
    ):
        raise DataError(
            f"the store {corpus.store} was tokenized with {fp.get('tokenizer')!r}, this run uses {tok!r}: set [data] "
            f"tokenizer = {fp.get('tokenizer')!r}, or prepare the store again with --tokenizer {tok}"
        )


def _say_other_stores(store: Path, fp: dict, phase) -> None:
    """Name a store of the same source prepared with other settings (why this run prepares a new one)."""
    from flexorch.data.store.fingerprint import describe_change

    if store.exists() or not store.parent.is_dir():
        return
    for other in sorted(store.parent.glob("*/manifest.json"))[:200]:
        try:
            old = json.loads(other.read_text())["fingerprints"]
        except (OSError, ValueError, KeyError):
            continue
        if old.get("source") == fp["source"]:
            phase(f"a store of this source exists with other settings ({describe_change(old, fp)}): {other.parent}")
            return


def _opened(corpus: Corpus, t0: float, publish, what: str) -> Corpus:
    corpus.stats["load_s"] = round(time.perf_counter() - t0, 3)
    if publish is not None:
        msg = (
            f"{what}: {corpus.num_docs:,} documents, {corpus.total_tokens:,} tokens in "
            f"{time.perf_counter() - t0:.1f} s ({corpus.store})"
        )
        publish({"event": "progress", "message": msg})
    return corpus


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
