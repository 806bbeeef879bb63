"""A byte-level BPE tokenizer trained on the run's own corpus (``[data] tokenizer = "bpe:<N>"``), in seconds.

`prepare_tokenizer` runs at the start of a run (``TrainingDriver.setup``, before the corpus is loaded): it trains
a BPE of N ids with the ``tokenizers`` library (ByteLevel pre-tokenizer and decoder, the 256 byte symbols as the
initial alphabet, ``<s>`` = id 0 as the BOS) on a bounded, deterministic sample of the corpus: the documents of
the sorted source listing in order (the same files `load_corpus` reads; for the default corpus the standard
library's ``.py`` files) until `SAMPLE_BYTES` of text. It saves the tokenizer as a Transformers directory
(``PreTrainedTokenizerFast.save_pretrained``) in ``<run_dir>/tokenizer``, so ``AutoTokenizer.from_pretrained``
loads it and ``flexorch export`` copies it next to an exported model, and returns the corpus config with
``tokenizer = 'hf:<run_dir>/tokenizer'``: the corpus, the workers and the saved run config all see that spec.

A new run on the same source and N copies the one trained before from the corpus cache (``[data] cache``:
``tokenizers/``), so its corpus store is found too and nothing is tokenized again. A resumed run (or any second
call) finds the directory and reuses it when it was trained for the same N
(``flexorch_bpe.json`` records the spec and the sample); another N is an error, never a silent retrain, since the
checkpoint's embedding rows belong to the ids of the first tokenizer.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path

from flexorch.config.data import CorpusConfig, bpe_vocab
from flexorch.data.errors import DataError
from flexorch.data.listing import list_source
from flexorch.data.record_kinds import kind_fields, record_text, resolve_kind
from flexorch.data.source_records import parse_record, record_rows

__all__ = ["SAMPLE_BYTES", "TOKENIZER_DIR", "prepare_tokenizer", "sample_documents", "train_bpe"]

SAMPLE_BYTES = 8 << 20
"""Text the BPE is trained on, at most (the first documents of the sorted listing)."""
TOKENIZER_DIR = "tokenizer"
"""The directory under ``run_dir`` the trained tokenizer is saved in."""
META_FILE = "flexorch_bpe.json"
"""What flexorch writes beside the tokenizer files: the spec it was trained for and the sample it saw."""
BOS = "<s>"


def prepare_tokenizer(cfg: CorpusConfig, run_dir: Path | str) -> CorpusConfig:
    """For ``tokenizer = 'bpe:<N>'``: train the BPE into ``run_dir/tokenizer`` (or reuse the one there, trained
    for the same N) and return `cfg` with ``tokenizer = 'hf:<absolute run_dir>/tokenizer'``; any other spec:
    `cfg` unchanged. Prints one line when it trains (vocabulary, sample size, seconds)."""
    n = bpe_vocab(cfg.tokenizer)
    if n is None:
        return cfg
    out = Path(os.path.abspath(Path(run_dir).expanduser())) / TOKENIZER_DIR
    if out.exists():
        _check_reusable(out, cfg.tokenizer)
    elif (cached := _cached(cfg, n)).is_dir():  # trained before on this source, for this N: the same tokenizer
        _copy_dir(cached, out)
        print(
            f"flexorch: tokenizer {cfg.tokenizer} as trained before on this corpus ({cached}) -> {out}", file=sys.stderr
        )
    else:
        info = train_bpe(cfg, n, out)
        _copy_dir(out, _cached(cfg, n))
        print(
            f"flexorch: trained tokenizer {cfg.tokenizer} on the corpus: {info['trained_vocab']} ids from "
            f"{info['sample_bytes'] / 2**20:.1f} MiB of text ({info['sample_documents']} documents) in "
            f"{info['seconds']:.1f} s -> {out}",
            file=sys.stderr,
            flush=True,
        )
    return dataclasses.replace(cfg, tokenizer=f"hf:{out}")


def _cached(cfg: CorpusConfig, n: int) -> Path:
    """Where the corpus cache keeps the BPE of this source (its files' fingerprint) and N: a new run on the same
    data reuses it instead of training again (the training is deterministic; the store key then matches too)."""
    import hashlib

    from flexorch.data.corpus import default_cache_dir
    from flexorch.data.store.fingerprint import source_files

    listing = list_source(cfg)
    key = json.dumps([listing.source, source_files(listing), n, SAMPLE_BYTES, cfg.format, cfg.records, cfg.text_field])
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return Path(cfg.cache or default_cache_dir()).expanduser() / "tokenizers" / f"bpe{n}-{digest}"


def _copy_dir(src: Path, dst: Path) -> None:
    """Copy a tokenizer directory whole or not at all (a temporary copy renamed into place)."""
    if dst.exists():
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    try:
        os.replace(tmp, dst)
    except OSError:  # another run put it there first
        shutil.rmtree(tmp, ignore_errors=True)


def _check_reusable(out: Path, spec: str) -> None:
    meta_path = out / META_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        raise DataError(
            f"{out} exists but holds no tokenizer flexorch trained (no readable {META_FILE}); tokenizer = {spec!r} "
            "trains one there: remove that directory or use another run_dir"
        ) from None
    if meta.get("spec") != spec:
        raise DataError(
            f"{out} holds the tokenizer trained for {meta.get('spec')!r}, but this run asks for {spec!r}; a run "
            f"(and its resume) keeps one tokenizer: set [data] tokenizer = {meta.get('spec')!r}, or use a new "
            "run_dir to train another"
        )


def train_bpe(cfg: CorpusConfig, vocab_size: int, out: Path | str) -> dict:
    """Train a byte-level BPE of `vocab_size` ids on the sample of `cfg`'s corpus and save it as a Transformers
    tokenizer directory `out` (written whole or not at all). Returns the facts recorded in ``flexorch_bpe.json``:
    ``spec``, ``vocab_size``, ``trained_vocab`` (fewer than N when the sample has too few distinct pairs),
    ``sample_bytes``, ``sample_documents``, ``source``, ``seconds``."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise DataError(
            f"tokenizer 'bpe:{vocab_size}' needs the tokenizers and transformers packages: pip install transformers "
            "(or use the tokenizer 'byte', which needs nothing)"
        ) from None
    t0 = time.perf_counter()
    docs, n_bytes, source = sample_documents(cfg, SAMPLE_BYTES)
    if not docs:
        raise DataError(
            f"tokenizer 'bpe:{vocab_size}': {source} has no UTF-8 text documents to train it on; point [data] "
            "source at your text, or use the tokenizer 'byte'"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    if tok.token_to_id(BOS) != 0:
        raise DataError(f"the trained BPE gave {BOS} the id {tok.token_to_id(BOS)}, not 0; this is a bug")
    # AutoTokenizer users get the BOS first too, as in training (flexorch itself prepends it: add_special_tokens=False)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, clean_up_tokenization_spaces=False)
    info = {
        "spec": f"bpe:{vocab_size}",
        "vocab_size": vocab_size,
        "trained_vocab": tok.get_vocab_size(),
        "sample_bytes": n_bytes,
        "sample_documents": len(docs),
        "source": source,
        "seconds": round(time.perf_counter() - t0, 3),
    }
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        wrapped.save_pretrained(str(tmp))
        (tmp / META_FILE).write_text(json.dumps(info, indent=1) + "\n")
        out.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, out)  # whole or not at all: a crash mid-save leaves no half tokenizer to reuse
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def sample_documents(cfg: CorpusConfig, budget: int = SAMPLE_BYTES) -> tuple[list[str], int, str]:
    """The first documents of `cfg`'s corpus, in the sorted listing's order, until `budget` bytes of UTF-8 text
    (the last one cut at a character boundary): ``(texts, bytes, source)``. Documents the corpus loader would skip
    (binary, NUL bytes, invalid UTF-8, no text) are skipped here too."""
    listing = list_source(cfg)
    kind = resolve_kind(listing, cfg)
    if kind == "tokenized":
        raise DataError(
            f"{listing.source} holds tokenized records (input_ids): they need no tokenizer and a BPE cannot be "
            "trained on them; leave [data] tokenizer unset"
        )
    docs: list[str] = []
    total = 0
    for path in listing.files:
        texts = _file_documents(path, listing.fmt, cfg.text_field, budget - total)
        if kind != "text":  # chat, prompt/completion: the turns' words, not the records' JSON
            texts = _record_texts(path, listing.fmt, kind, cfg)
        for text in texts:
            data = text.encode("utf-8")
            if total + len(data) > budget:  # cut the last document at a character boundary
                data = data[: budget - total]
                text = data.decode("utf-8", errors="ignore")
            docs.append(text)
            total += len(data)
            if total >= budget:
                return docs, total, listing.source
    return docs, total, listing.source


def _record_texts(path: str, fmt: str, kind: str, cfg: CorpusConfig):
    """The text of each chat or prompt/completion record of one file (``record_kinds.record_text``)."""
    import pyarrow as pa

    fields = kind_fields(kind, cfg)
    if fmt == "jsonl":
        with open(path, "rb") as f:
            for line in f:
                row, _, _, _ = parse_record(line, fields) if line.strip() else (None, None, (), None)
                text = record_text(kind, row, cfg) if row is not None else None
                if text:
                    yield text
        return
    if fmt == "parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path, columns=[f for f in fields if f in pq.read_schema(path).names])
    else:  # hf_dataset: an Arrow stream file
        with pa.memory_map(path) as src:
            table = pa.ipc.open_stream(src).read_all()
    for row in record_rows(table, fields):
        text = record_text(kind, row, cfg) if row is not None else None
        if text:
            yield text


def _file_documents(path: str, fmt: str, field: str, budget: int):
    """The texts of one file (at most about `budget` bytes read from a text file)."""
    if fmt == "text":
        with open(path, "rb") as f:
            data = f.read(budget)
        if data and b"\0" not in data:
            try:  # a final partial character (cut at `budget`) is held back, not an error
                text = codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
            except UnicodeDecodeError:
                return
            if text:
                yield text
    elif fmt == "jsonl":
        with open(path, "rb") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                text = rec.get(field) if isinstance(rec, dict) else None
                if isinstance(text, str) and text and "\0" not in text:
                    yield text
    else:  # parquet
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        if field not in pf.schema_arrow.names:
            return
        for batch in pf.iter_batches(batch_size=256, columns=[field]):
            for value in batch.column(0).to_pylist():
                if isinstance(value, bytes):
                    try:
                        value = value.decode("utf-8")
                    except UnicodeDecodeError:
                        continue
                if isinstance(value, str) and value and "\0" not in value:
                    yield value
