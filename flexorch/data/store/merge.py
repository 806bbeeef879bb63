"""The merge step of a prepare: the units' metadata files -> one checked, numbered index -> ``index/`` + manifest.

Each unit task writes its block's metadata (`save_unit_meta`: the per-record and per-document arrays of
``flexorch.data.readers.pack_records``, with document offsets made block-relative); the preparing process reads them
all back (`load_unit_meta`), continues a JSONL file's rows and line numbers across its ranges, merges them with the
checks and numbering of a whole-corpus read (``flexorch.data.readers.assemble_index``), writes the per-document
index arrays and, last, the manifest (`finalize`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from flexorch.data.store import layout

__all__ = ["finalize", "load_unit_meta", "save_unit_meta"]

_META_ARRAYS = ("rec_path", "rec_row", "rec_status", "rec_tokens", "rec_short") + tuple(
    f"doc_{k}" for k in ("rec", "piece", "block", "offset", "length", "targets")
)


def save_unit_meta(paths: dict, meta: dict, starts: list[int], lines: int | None) -> None:
    """Write one unit's metadata (``paths["meta"]``, atomically), its document offsets counted from the block's start.

    ``starts``: where each of `pack_records`' token buffers begins in the block (``doc_block`` holds a document's
    buffer until here, then its block within the unit: 0); ``lines``: a JSONL range's newlines (None for other
    formats)."""
    starts_arr = np.asarray(starts or [0], dtype=np.int64)
    meta["doc_offset"] = (
        starts_arr[meta["doc_block"]] + meta["doc_offset"] if len(meta["doc_block"]) else meta["doc_offset"]
    )
    meta["doc_block"] = np.zeros_like(meta["doc_block"])
    if lines is not None:  # where this range sits in its file: the merge turns local rows and lines into the file's
        meta["lines"] = lines
    arrays = {k: meta[k] for k in _META_ARRAYS}
    rest = {k: v for k, v in meta.items() if k not in _META_ARRAYS}
    rest["bad"] = [list(b) for b in rest["bad"]]
    rest["bad_kind"] = [list(b) for b in rest["bad_kind"]]
    rest["columns"] = sorted(rest["columns"])
    tmp_meta = paths["meta"].with_name(f".{paths['meta'].name}.tmp{os.getpid()}.npz")
    np.savez(tmp_meta, info=np.frombuffer(json.dumps(rest).encode(), dtype=np.uint8), **arrays)
    os.replace(tmp_meta, paths["meta"])


def load_unit_meta(store: Path, i: int) -> dict:
    with np.load(layout.block_paths(store, i)["meta"]) as z:
        meta = {k: z[k] for k in _META_ARRAYS}
        meta |= json.loads(bytes(z["info"]).decode())
    meta["bad"] = [tuple(b) for b in meta["bad"]]
    meta["bad_kind"] = [tuple(b) for b in meta["bad_kind"]]
    return meta


def finalize(out: Path, cfg, listing, kind: str, plan: dict, spec: dict, fp: dict, say, seconds: float) -> dict:
    """Merge the units' indices (checks, numbering, stats), write ``index/`` and then the manifest."""
    from flexorch.data.readers import assemble_index

    units = plan["units"]
    metas = [load_unit_meta(out, i) for i in range(len(units))]
    dones = [json.loads(layout.block_paths(out, i)["done"].read_text()) for i in range(len(units))]
    if listing.fmt == "jsonl":
        _continue_ranges(units, metas)
    tok_name = "pre-tokenized" if kind == "tokenized" else _tokenizer_name(cfg)
    blocks = [[i] if d["tokens"] else [] for i, d in enumerate(dones)]
    index = assemble_index(cfg, listing, metas, blocks, tok_name, kind)
    arrays = _index_arrays(index, dones, len(units))
    (out / "index").mkdir(exist_ok=True)
    for name, arr in arrays.items():
        layout.atomic_save_npy(out / "index" / f"{name}.npy", arr)
    keys = index["keys"]
    layout.atomic_write_json(out / "index" / "key_names.json", {"fmt": keys["fmt"], "names": keys["names"]})
    manifest = _manifest(out, kind, spec, fp, index["stats"], dones, sorted(arrays), tok_name, seconds)
    layout.atomic_write_json(out / "manifest.json", manifest)
    rate = manifest["tokens"] / max(seconds, 1e-9)
    say(
        {
            "event": "progress",
            "message": (
                f"prepared the corpus: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens in "
                f"{len(manifest['parts'])} blocks ({np.dtype(spec['dtype']).name}) in {seconds:.1f} s "
                f"({rate / 1e6:.2f}M tokens/s) -> {out}"
            ),
        }
    )
    return manifest


def _continue_ranges(units: list[dict], metas: list[dict]) -> None:
    """Rows and line numbers of a JSONL range continue from the ranges before it in its file (in place)."""
    rows_before: dict[str, int] = {}
    lines_before: dict[str, int] = {}
    for unit, meta in zip(units, metas, strict=True):
        f = unit["files"][0]
        r0, l0 = rows_before.get(f, 0), lines_before.get(f, 0)
        meta["rec_row"] = meta["rec_row"] + r0
        meta["bad"] = [(rel, line + l0, why) for rel, line, why in meta["bad"]]
        meta["bad_kind"] = [(r, why) for r, why in meta["bad_kind"]]
        rows_before[f] = r0 + len(meta["rec_status"])
        lines_before[f] = l0 + int(meta["lines"])


def _index_arrays(index: dict, dones: list[dict], n_units: int) -> dict[str, np.ndarray]:
    """The per-document arrays of ``index/``: lengths, block ("part": the store format's name), offset, the key's
    components and (masked kinds) targets."""
    nonempty = np.asarray([i for i, d in enumerate(dones) if d["tokens"]] or [0], dtype=np.int32)
    keys = index["keys"]
    max_offset = int(index["doc_offsets"].max()) if len(index["doc_offsets"]) else 0
    arrays = {
        "lengths": index["lengths"].astype(np.int32),
        # the narrowest types that hold them: the driver maps these (4 + 2 + 4 bytes a document, with the lengths)
        "part": nonempty[index["doc_blocks"]].astype(np.uint16 if n_units <= 1 << 16 else np.int32),
        "offset": index["doc_offsets"].astype(np.uint32 if max_offset < 1 << 32 else np.int64),
        "key_path": keys["path"],
        "key_row": keys["row"].astype(np.int64),
        "key_piece": keys["piece"],
    }
    if index["targets"] is not None:
        arrays["targets"] = index["targets"].astype(np.int32)
    return arrays


def _manifest(out: Path, kind: str, spec: dict, fp: dict, stats: dict, dones: list, index: list, tok_name, seconds):
    """The store's manifest: format, fingerprints, token type and vocabulary, counts, blocks (under the format's key
    "parts"), index arrays, stats."""
    vocab = stats["max_token_id"] + 1 if kind == "tokenized" else spec["vocab_size"]
    blocks = [
        {
            "file": layout.block_paths(out, i)["bin"].name,
            "sums": layout.block_paths(out, i)["sums"].name,
            "bytes": d["bytes"],
            "tokens": d["tokens"],
            "documents": d["documents"],
            "sha256": d["sha256"],
        }
        for i, d in enumerate(dones)
    ]
    stats |= {"prepare_s": round(seconds, 3), "parts": len(blocks)}  # "parts": the store format's name
    return {
        "format": layout.FORMAT,
        "fingerprints": fp,
        "dtype": spec["dtype"],
        "tokenizer_name": tok_name,
        "vocab_size": int(vocab),
        "documents": int(stats["documents"]),
        "tokens": int(stats["tokens"]),
        "targets": int(stats["targets"]),
        "parts": blocks,  # the store format's name for its blocks
        "index": index,
        "stats": stats,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _tokenizer_name(cfg) -> str:
    from flexorch.data.tokenizer import get_tokenizer

    return get_tokenizer(cfg.tokenizer).name
