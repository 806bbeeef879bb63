"""Reading a sharded checkpoint from an object store in few requests: DCP's fsspec reader, over the pyarrow
filesystem corpora are read with (``flexorch.data.store.remote``), whose reads of each file are coalesced into a few
large ranged reads covering what this rank needs of it (:class:`ObjectStoreReader`; ``workers.sharded_checkpoint``
uses it to load from ``s3://`` and ``gs://``).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import io
import os

from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as _FsspecFileSystem  # not re-exported
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

__all__ = ["RANGE_GAP", "RANGE_MAX", "ObjectStoreReader"]


RANGE_GAP = 5 << 20
"""Bytes between two items a rank needs that one ranged read fetches rather than start another request: about what
arrives in the time to a first byte (Arrow's ``CacheOptions.from_network_metrics(50 ms, 100 MiB/s)``, the rule its
read coalescing for Parquet over S3 uses, gives 5 MiB)."""
RANGE_MAX = 45 << 20
"""The most bytes one ranged read fetches (one item larger is fetched whole): large enough that a request's latency
is a small part of it (the same Arrow rule gives 45 MiB), and what a rank holds of a file at once while loading."""


def _coalesce(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranges (start, end) of few requests that cover the byte ``spans`` of a file: sorted, and merged across
    holes of at most :data:`RANGE_GAP` up to :data:`RANGE_MAX` bytes."""
    out: list[list[int]] = []
    for start, end in sorted(spans):
        if out and start - out[-1][1] <= RANGE_GAP and max(end, out[-1][1]) - out[-1][0] <= RANGE_MAX:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


class ObjectStoreReader(FsspecReader):
    """DCP's fsspec reader, over a pyarrow object-store filesystem, that fetches each file's bytes in ranged reads
    covering what this rank needs of it (:func:`_coalesce`) and serves DCP's reads from memory. DCP's own reader
    (``torch.distributed.checkpoint.filesystem.FileSystemReader.read_data``: "TODO sort by offset and cache the
    reading") opens each file once but seeks to each item and lets ``torch.load`` read it record by record, and each
    read of a pyarrow S3 file is a ranged GET of its own: on a moto server on loopback, a checkpoint of 120 small
    parameters and their AdamW state (480 tensors) loaded in 11,547 requests and 38-50 s, and one of 40 4 MiB ones
    in 3,855 requests and 609 s; read here, in 6 requests and 0.3-0.5 s, and 11 requests and 3.1 s. The items are
    read in the order of their offsets, so each range is fetched once, and only the range being read is held."""

    def __init__(self, fs, path: str):
        super().__init__(path)
        self.fs = _RangedFileSystem(fs)

    def read_data(self, plan, planner):
        info = self.storage_data
        items = sorted(plan.items, key=lambda r: (info[r.storage_index].relative_path, info[r.storage_index].offset))
        spans: dict[str, list[tuple[int, int]]] = {}
        for item in items:
            where = info[item.storage_index]
            spans.setdefault(self.fs.concat_path(self.path, where.relative_path), []).append(
                (where.offset, where.offset + where.length)
            )
        self.fs.ranges = {path: _coalesce(s) for path, s in spans.items()}
        return super().read_data(dataclasses.replace(plan, items=items), planner)


class _RangedFileSystem(_FsspecFileSystem):
    """The filesystem of :class:`ObjectStoreReader`: a data file opens as a :class:`_RangedFile` of the ranges
    planned for it (``ranges``, by path); any other file DCP reads (``.metadata``) is fetched whole, in one request."""

    def __init__(self, fs):
        from fsspec.implementations.arrow import ArrowFSWrapper

        super().__init__()
        self.arrow = fs
        self.fs = ArrowFSWrapper(fs)
        self.ranges: dict[str, list[tuple[int, int]]] = {}

    def init_path(self, path, **kwargs):
        return path  # in the object store this filesystem is given, not the one fsspec would guess from it

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        path = os.fspath(path)
        if mode != "rb":
            with super().create_stream(path, mode) as stream:
                yield stream
        elif path in self.ranges:
            with _RangedFile(self.arrow.open_input_file(path), self.ranges[path]) as stream:
                yield stream
        else:
            with self.arrow.open_input_file(path) as stream:
                data = stream.read()  # one request of the whole (an input stream reads 256 KiB per request)
            yield io.BytesIO(data)


class _RangedFile(io.RawIOBase):
    """A random-access file whose planned ``ranges`` are each fetched by one ranged read (``read_at``) when first
    read; only the range fetched last is held. A read outside them (none, while DCP reads only the items it
    planned) is fetched on its own."""

    def __init__(self, source, ranges: list[tuple[int, int]]):
        super().__init__()
        self._source, self._ranges = source, ranges
        self._starts = [start for start, _ in ranges]
        self._pos = 0
        self._held: tuple[int, memoryview] = (0, memoryview(b""))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_CUR:
            offset += self._pos
        elif whence != io.SEEK_SET:
            raise io.UnsupportedOperation("a ranged object-store file seeks from its start only")
        self._pos = offset
        return offset

    def readinto(self, buffer) -> int:
        out = memoryview(buffer).cast("B")
        done = 0
        while done < len(out):
            data = self._bytes_at(self._pos, len(out) - done)
            if not data:
                break
            n = min(len(data), len(out) - done)
            out[done : done + n] = data[:n]
            done += n
            self._pos += n
        return done

    def _bytes_at(self, pos: int, want: int) -> memoryview:
        """The bytes from ``pos`` to the end of the range holding it, fetched if it is not the one held."""
        start, data = self._held
        if not start <= pos < start + len(data):
            i = bisect.bisect_right(self._starts, pos) - 1
            start, end = self._ranges[i] if i >= 0 and pos < self._ranges[i][1] else (pos, pos + want)
            del data  # the range held is let go before the next is fetched
            self._held = (start, memoryview(b""))
            data = memoryview(self._source.read_at(end - start, start))
            self._held = (start, data)
        return data[pos - start :]

    def close(self) -> None:
        self._held = (0, memoryview(b""))
        self._source.close()
        super().close()
