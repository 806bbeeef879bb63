"""``flexorch prepare SOURCE OUT``: tokenize a corpus once, in parallel over the Ray cluster, into a store that
``flexorch train`` (``[data] source = OUT`` or ``--data OUT``) opens in milliseconds (``flexorch.data.store``).
Run again on a finished store, it checks every block's sha256 and prepares again only the blocks that differ.

The ``[data]`` settings come from ``--config`` (a run TOML: its ``[data]`` table, with a ``[model] hf`` model's
tokenizer) and the flags, which win. ``OUT`` is a directory, or an ``s3://``/``gs://`` URI: the store is prepared
in a local directory first (``--local-dir``, default a temporary one) and then uploaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from flexorch.data.lengths import parse_tokens

__all__ = ["add_prepare_parser", "cmd_prepare"]


def add_prepare_parser(sub) -> None:
    p = sub.add_parser(
        "prepare",
        help="tokenize a corpus once, in parallel, into a memory-mapped token store that `train` opens at once",
    )
    p.add_argument("source", help="directory of text/code files, .jsonl, .parquet, or a datasets directory")
    p.add_argument("out", help="store directory to write (or s3://bucket/prefix, gs://...)")
    p.add_argument("--config", type=Path, help="TOML run file whose [data] settings to use (flags win)")
    p.add_argument("--format", help="text | jsonl | parquet | hf_dataset | auto (default auto)")
    p.add_argument("--records", help="text | chat | prompt_completion | tokenized | auto (default auto)")
    p.add_argument("--text-field", help="JSONL/Parquet field with the text (default text)")
    p.add_argument("--tokenizer", help="byte | hf:<dir> (default: the config's, else byte); bpe:N needs a run")
    p.add_argument("--max-context", help="longest document in tokens, e.g. 8K (default 2048)")
    p.add_argument("--over-long", choices=["split", "drop", "reject"], help="documents over --max-context")
    p.add_argument("--parallelism", type=int, help="unit tasks at once (default: every CPU of the cluster)")
    p.add_argument("--part-mb", type=float, help="source MiB per block (default: 4 blocks per CPU, 4-128 MiB)")
    p.add_argument("--address", help="Ray cluster to run on (default RAY_ADDRESS, else a local Ray)")
    p.add_argument("--local-dir", type=Path, help="with an s3:// or gs:// OUT: where to prepare before uploading")


def _data_config(args: argparse.Namespace):
    from flexorch.config import CorpusConfig, load_train_config

    data = load_train_config(args.config).data if args.config is not None else CorpusConfig()
    changes = {
        "source": args.source,
        "format": args.format,
        "records": args.records,
        "text_field": args.text_field,
        "tokenizer": args.tokenizer,
        "max_context": parse_tokens(args.max_context) if args.max_context else None,
        "over_long": args.over_long,
    }
    data = dataclasses.replace(data, **{k: v for k, v in changes.items() if v is not None})
    if data.tokenizer == "auto":
        data = dataclasses.replace(data, tokenizer="byte")
    if data.tokenizer.startswith("bpe:"):
        raise ValueError(
            f"tokenizer {data.tokenizer!r} is trained per run; prepare with a tokenizer directory ('hf:<dir>', e.g. "
            "the run's <run_dir>/tokenizer) or let `flexorch train` prepare into [data] cache"
        )
    return data


def cmd_prepare(args: argparse.Namespace) -> int:
    from flexorch.data.store.prepare import prepare_store

    data = _data_config(args)
    remote = args.out.startswith(("s3://", "gs://"))
    local = args.local_dir or (Path(tempfile.mkdtemp(prefix="flexorch-prepare-")) if remote else Path(args.out))
    if args.address:
        import ray

        ray.init(address=args.address, logging_level="WARNING", log_to_driver=False)

    def say(ev: dict) -> None:
        print(ev.get("message", ev), flush=True)

    unit_bytes = int(args.part_mb * 2**20) if args.part_mb else None
    manifest = prepare_store(data, local, say, parallelism=args.parallelism, unit_bytes=unit_bytes, verify=True)
    if remote:
        from flexorch.data.store.remote import upload_dir

        say({"message": f"uploading {local} to {args.out}"})
        upload_dir(str(local), args.out)
    st = manifest["stats"]
    print(
        f"flexorch prepare: {args.out}: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens "
        f"({manifest['dtype']}), {len(manifest['parts'])} blocks; skipped: {st.get('skipped_binary', 0)} binary, "
        f"{st.get('skipped_empty', 0)} empty, {st.get('bad_records', 0)} malformed, {st.get('dropped_over_long', 0)} "
        f"over-long; {st.get('split_docs', 0)} split. Train on it: flexorch train --data {args.out}",
        flush=True,
    )
    return 0
