"""Reading documents from a store's token blocks, on a worker or the driver: (block, offset, length) -> tokens.

A block is one stored file of tokens (``parts/part-NNNNN.bin`` in the store's layout, ``flexorch.data.store.layout``).
The driver sends each rank descriptors of its documents (``flexorch.work.step.DocRef``: block index, offset,
length) and a :class:`BlockSpec` per block it reads, never tokens. A worker opens a block once per process, by
memory map for a local or shared filesystem path, or by range reads through ``pyarrow.fs`` (``s3://``, ``gs://``)
with a bounded local cache (``flexorch.data.store.remote``), and checks each MiB chunk it reads against the block's
digests the first time (a corrupted block is named in a :class:`~flexorch.data.errors.DataError`; a truncated one
is caught by its size). The tokens come back as ``int32`` arrays as stored (a loss mask as ``~id``:
``flexorch.data.targets``): :func:`open_blocks` opens a step's blocks, :func:`fetch_documents` cuts its documents
out of them.

Pure numpy (+ pyarrow for object stores): no Ray, no torch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from flexorch.data.errors import DataError
from flexorch.data.store.layout import HASH_CHUNK

__all__ = ["BlockReader", "BlockSpec", "block_reader", "fetch_documents", "open_blocks"]


@dataclass(frozen=True)
class BlockSpec:
    """Where one block's tokens live and how to check them (small: it travels with every step's message)."""

    path: str
    """Local path or object-store URI of the block's ``.bin``."""
    sums: str
    """Its per-MiB digests (``.sums.npy``), a path or URI."""
    dtype: str
    """Numpy dtype string of the stored ids ('<u2', '<i2', '<u4', '<i4')."""
    tokens: int
    """Tokens in the block (its size is ``tokens * itemsize``)."""


class _OpenBlock:
    """One opened block: ``block[a:b]`` -> int32 tokens a..b-1, the chunks they lie in checked once."""

    def __init__(self, spec: BlockSpec, cache_dir: str | None):
        self.spec, self.dtype = spec, np.dtype(spec.dtype)
        self.nbytes = spec.tokens * self.dtype.itemsize
        self.checked: set[int] = set()
        self.remote = _is_remote(spec.path)
        if self.remote:
            from flexorch.data.store import remote

            self.source = remote.open_range_source(spec.path, cache_dir=cache_dir, chunk_bytes=HASH_CHUNK)
            self.sums = np.load(remote.fetch_small(spec.sums, cache_dir=cache_dir))
            size = self.source.size
        else:
            import os

            try:
                size = os.path.getsize(spec.path)
                self.sums = np.load(spec.sums)
            except OSError as e:
                raise DataError(
                    f"corpus block {spec.path} cannot be read here ({type(e).__name__}: {e}); on a cluster put "
                    "[data] cache (or the prepared store) on a filesystem every node mounts, or on s3://"
                ) from None
            self.mm = np.memmap(spec.path, dtype=self.dtype, mode="r", shape=(spec.tokens,)) if spec.tokens else None
        if size != self.nbytes:
            raise DataError(
                f"corpus block {spec.path} has {size:,} bytes, its manifest says {self.nbytes:,} (truncated or "
                "replaced); run `flexorch prepare` on the source again: it redoes only the damaged block"
            )

    def __getitem__(self, s: slice) -> np.ndarray:
        a, b, _ = s.indices(self.spec.tokens)
        if b <= a:
            return np.zeros(0, dtype=np.int32)
        lo, hi = a * self.dtype.itemsize, b * self.dtype.itemsize
        for c in range(lo // HASH_CHUNK, (hi - 1) // HASH_CHUNK + 1):
            if c not in self.checked:
                self._check(c)
        if self.remote:
            raw = self.source.read(lo, hi - lo)
            return np.frombuffer(raw, dtype=self.dtype).astype(np.int32)
        return np.asarray(self.mm[a:b]).astype(np.int32)

    def _check(self, c: int) -> None:
        lo, hi = c * HASH_CHUNK, min(self.nbytes, (c + 1) * HASH_CHUNK)
        size = self.dtype.itemsize  # HASH_CHUNK is a multiple of every itemsize
        raw = self.source.read(lo, hi - lo) if self.remote else self.mm[lo // size : hi // size].tobytes()
        digest = int.from_bytes(hashlib.blake2b(bytes(raw), digest_size=8).digest(), "little")
        if c >= len(self.sums) or digest != int(self.sums[c]):
            raise DataError(
                f"corpus block {self.spec.path} is corrupted: bytes {lo:,}-{hi:,} do not match its digest "
                f"({self.spec.sums}); run `flexorch prepare` on the source again (it redoes the damaged block) or "
                "remove the store to prepare it anew"
            )
        self.checked.add(c)


def _identity(path: str) -> tuple:
    """A local file's inode and modification time (a replaced block is opened anew); remote: none."""
    if _is_remote(path):
        return ()
    import os

    try:
        st = os.stat(path)
    except OSError:
        return ()
    return (st.st_ino, st.st_mtime_ns)


def _is_remote(path: str) -> bool:
    return path.startswith(("s3://", "gs://"))


class BlockReader:
    """The blocks this process has opened (each once), by path."""

    def __init__(self, cache_dir: str | None = None):
        self.cache_dir = cache_dir
        self._open: dict[str, _OpenBlock] = {}

    def open(self, spec: BlockSpec) -> _OpenBlock:
        """The opened block (again when the file was replaced since: a block prepared anew)."""
        ident = (spec, _identity(spec.path))
        block = self._open.get(spec.path)
        if block is None or block.ident != ident:
            block = _OpenBlock(spec, self.cache_dir)
            block.ident = ident
            self._open[spec.path] = block
        return block

    def blocks(self, specs: dict[int, BlockSpec]) -> dict[int, _OpenBlock]:
        """``{block index: opened block}``: what the step executors index as ``blocks[b][offset : offset + n]``."""
        return {b: self.open(s) for b, s in specs.items()}


_READER: BlockReader | None = None


def block_reader() -> BlockReader:
    """This process's reader (a worker keeps its blocks open across steps)."""
    global _READER
    if _READER is None:
        _READER = BlockReader()
    return _READER


def open_blocks(specs: dict) -> dict:
    """``{block index: tokens indexable by slice}``: each :class:`BlockSpec` opened once in this process (a worker
    keeps them across steps); any other value (an in-memory corpus's arrays) as it is."""
    reader = block_reader()
    return {b: reader.open(s) if isinstance(s, BlockSpec) else s for b, s in specs.items()}


def fetch_documents(blocks: dict, locations) -> list[np.ndarray]:
    """Token arrays (int32, as stored) of `locations` (``DocRef``s) from the opened blocks of :func:`open_blocks`."""
    out = []
    for loc in locations:
        if loc.block not in blocks:
            raise KeyError(
                f"block {loc.block} of document {loc.doc_id} was not passed; use corpus.block_specs(its blocks)"
            )
        out.append(blocks[loc.block][loc.offset : loc.offset + loc.length])
    return out
