"""The on-disk layout of a prepared corpus store, its manifest, and atomic writes. Pure Python + numpy, no Ray.

A store is a directory (the anchors: Megatron-Core's indexed datasets, a ``.bin`` of tokens and an ``.idx`` of
lengths and pointers; MosaicML Streaming's immutable shards with an index of hashes)::

    STORE/
      plan.json                      the work units (which source bytes each block reads) and the fingerprints
      parts/part-00000.bin           tokens of unit 0, raw little-endian ``dtype`` (see below), ~256 MB at most
      parts/part-00000.sums.npy      a blake2b-64 digest per MiB of the .bin (workers check what they read)
      parts/part-00000.meta.npz      the unit's record and document index (lengths, offsets, target counts)
      parts/part-00000.done.json     written last: the unit finished (bytes, tokens, sha256 of the .bin)
      index/lengths.npy ...          per document in id order: lengths, targets, part (block), offset, key components
      manifest.json                  written last of all: the store is complete

Each ``parts/part-NNNNN.bin`` is one block: the stored piece of tokens a worker opens and reads documents from
(``flexorch.data.store.blocks``). "part" in file names, the manifest's ``"parts"`` list and the index's ``part``
array is the format's name for a block; the format keeps it so stores already prepared stay readable.

Every file is written to a temporary name and renamed into place, so a prepare killed midway leaves only whole
files; run again, it redoes only the units without a ``done.json``. Nothing lives in ``/dev/shm``.

Token dtype: ``uint16`` when every id fits (vocabulary <= 65,536), else ``uint32``; a source whose records carry a
loss mask stores a non-target token as ``~id`` (``flexorch.data.targets``), so it needs a sign: ``int16`` when the
vocabulary is <= 32,768, else ``int32``. Pre-tokenized records (ids unknown until read) use ``int32``.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import numpy as np

__all__ = [
    "FORMAT",
    "HASH_CHUNK",
    "INDEX_ARRAYS",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_save_npy",
    "check_manifest",
    "is_store",
    "block_paths",
    "read_manifest",
    "token_dtype",
]

FORMAT = "flexorch.store/1"
"""The manifest's ``format``: a store of another format is refused by name (prepare it again)."""
HASH_CHUNK = 1 << 20
"""Bytes per digest in a block's ``.sums.npy``: a worker checks the MiB chunks it reads, once per process."""
INDEX_ARRAYS = ("lengths", "targets", "part", "offset", "key_path", "key_row", "key_piece")
"""The per-document arrays under ``index/`` (``targets`` only for records with a loss mask)."""


def token_dtype(vocab_size: int | None, masked: bool) -> np.dtype:
    """The narrowest dtype that holds every stored id (see the module doc); ``vocab_size`` None: unknown (int32)."""
    if vocab_size is None:
        return np.dtype("<i4")
    if masked:
        return np.dtype("<i2") if vocab_size <= 1 << 15 else np.dtype("<i4")
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def block_paths(store: str | Path, unit: int) -> dict[str, Path]:
    """The files of work unit ``unit``'s block: bin, sums, meta, done (the format's names: ``parts/part-NNNNN``)."""
    base = Path(store) / "parts" / f"part-{unit:05d}"
    return {k: base.with_name(base.name + ext) for k, ext in _BLOCK_FILES.items()}


_BLOCK_FILES = {"bin": ".bin", "sums": ".sums.npy", "meta": ".meta.npz", "done": ".done.json"}


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    tmp = _tmp(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: str | Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def atomic_save_npy(path: str | Path, array: np.ndarray) -> None:
    path = Path(path)
    tmp = _tmp(path)
    with open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(array))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_store(path: str | Path) -> bool:
    """True when ``path`` is a store directory (finished or not): it has a manifest or a prepare plan."""
    p = Path(path)
    return p.is_dir() and ((p / "manifest.json").is_file() or (p / "plan.json").is_file())


def read_manifest(store: str | Path) -> dict:
    """The manifest of a finished store, checked for its format; a clear error for an unfinished or foreign one."""
    from flexorch.data.errors import DataError

    p = Path(store)
    if not (p / "manifest.json").is_file():
        if (p / "plan.json").is_file():
            raise DataError(
                f"{p} is a corpus store whose prepare did not finish (no manifest.json); run `flexorch prepare` "
                "with the same source and settings again: it redoes only the blocks that were not finished"
            )
        raise DataError(f"{p} is not a prepared corpus store (no manifest.json); prepare one with `flexorch prepare`")
    try:
        manifest = json.loads((p / "manifest.json").read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{p}/manifest.json is unreadable ({type(e).__name__}: {e}); prepare the store again") from e
    return check_manifest(manifest, str(p))


def check_manifest(manifest: dict, where: str) -> dict:
    """``manifest`` when it is of this flexorch's store format, else a clear error naming ``where``."""
    from flexorch.data.errors import DataError

    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise DataError(
            f"{where} is a corpus store of format {got!r}; this flexorch reads {FORMAT!r}: prepare it again "
            "(`flexorch prepare`)"
        )
    return manifest
