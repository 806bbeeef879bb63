"""Document keys built on demand from three integer arrays, never held as one Python string per document.

A key names where a document came from (``flexorch.data.corpus``): ``relative/path.py`` (a text file),
``file.jsonl:N`` (N = 1-based record number), ``file.parquet:N`` / an ``hf_dataset`` Arrow file ``:N`` (0-based
row), and ``<key>#pieceK`` for piece K of a document split at ``max_context``. A store keeps, per document, the
index of its file in ``names``, its row and its piece (-1: not split), as arrays that may be memory-mapped; a key
costs nothing until it is asked for (a checkpoint's corpus fingerprint, an error message, a test).

Pure numpy: no Ray.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["DocKeys", "ListKeys"]


class DocKeys(Sequence):
    """``keys[i]`` is document i's key, formatted from ``names[path[i]]``, ``row[i]`` and ``piece[i]``."""

    def __init__(self, names: Sequence[str], fmt: str, path, row, piece):
        self.names, self.fmt = list(names), fmt
        self.path, self.row, self.piece = path, row, piece
        if not len(path) == len(row) == len(piece):
            raise ValueError(f"key arrays disagree: {len(path)} paths, {len(row)} rows, {len(piece)} pieces")

    def __len__(self) -> int:
        return len(self.path)

    def _key(self, i: int) -> str:
        name, row, piece = self.names[int(self.path[i])], int(self.row[i]), int(self.piece[i])
        base = name if self.fmt == "text" else f"{name}:{row + 1}" if self.fmt == "jsonl" else f"{name}:{row}"
        return base if piece < 0 else f"{base}#piece{piece}"

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._key(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        j = int(i) + n if int(i) < 0 else int(i)
        if not 0 <= j < n:
            raise IndexError(f"document {i} is out of range: there are {n} documents")
        return self._key(j)

    def index(self, key: str, start: int = 0, stop: int | None = None) -> int:
        """The id of the document named ``key`` (a scan: for tests and tools, not the step loop)."""
        for j in range(start, len(self) if stop is None else stop):
            if self._key(j) == key:
                return j
        raise ValueError(f"no document has key {key!r}")

    def __eq__(self, other) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self):  # a mutable-looking sequence: not hashable, like a list
        raise TypeError("unhashable type: 'DocKeys'")

    def __repr__(self) -> str:
        head = ", ".join(repr(k) for k in self[:3])
        return f"DocKeys([{head}{', ...' if len(self) > 3 else ''}], {len(self)} documents)"


class ListKeys(DocKeys):
    """Keys that are already strings (a combined corpus of ``[[tasks]]``: ``task/key``), through the same API."""

    def __init__(self, keys: Sequence[str]):
        self._keys = list(keys)
        self.names, self.fmt = [], "list"
        self.path = self.row = self.piece = np.zeros(0)

    def __len__(self) -> int:
        return len(self._keys)

    def _key(self, i: int) -> str:
        return self._keys[i]

    def index(self, key: str, start: int = 0, stop: int | None = None) -> int:
        return self._keys.index(key, start, len(self) if stop is None else stop)
