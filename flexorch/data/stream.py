"""Global batches of document ids: epoch-exact, seeded, resumable. Pure numpy, no Ray.

Every epoch is a seeded permutation of all document ids (`np.random.default_rng([seed, epoch])`, so an epoch's
order depends only on the seed and the epoch number) cut into consecutive slices of `batch_size`; the last slice of
an epoch may be smaller. Every document is used exactly once per epoch, none is dropped or repeated. The driver
calls `peek()` to plan step t+1 while step t runs, then `next_batch()` to take it. `state_dict()` is a plain
JSON-able dict; `load_state_dict()` continues at exactly the next document.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Batch", "DocumentStream"]

_STATE_KEYS = ("seed", "epoch", "position", "step", "num_docs", "batch_size")


@dataclass(frozen=True)
class Batch:
    """One global batch of document ids."""

    epoch: int
    """Data epoch (a full pass over the corpus) this batch belongs to."""
    index_in_epoch: int
    """0-based position of this batch within its epoch."""
    step: int
    """0-based global count of batches taken from the stream."""
    doc_ids: tuple[int, ...]
    """Document ids (corpus order numbers) in this batch."""

    def __len__(self) -> int:
        return len(self.doc_ids)


class DocumentStream:
    """Seeded, epoch-exact stream of global batches over `num_docs` documents."""

    def __init__(self, num_docs: int, batch_size: int, seed: int = 0):
        if int(num_docs) < 1:
            raise ValueError(f"num_docs must be >= 1, got {num_docs} (the corpus is empty)")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.num_docs, self.batch_size, self.seed = int(num_docs), int(batch_size), int(seed)
        self.epoch, self.position, self.step = 0, 0, 0
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    @property
    def batches_per_epoch(self) -> int:
        """Batches in one epoch (the last one may be smaller than batch_size)."""
        return -(-self.num_docs // self.batch_size)

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of document ids in `epoch` (a function of seed and epoch only)."""
        if self._perm_epoch != epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_docs)
            self._perm_epoch = epoch
        return self._perm

    def peek(self) -> Batch:
        """The next batch, without advancing the stream."""
        perm = self.permutation(self.epoch)
        ids = perm[self.position : self.position + self.batch_size]
        return Batch(
            epoch=self.epoch,
            index_in_epoch=self.position // self.batch_size,
            step=self.step,
            doc_ids=tuple(int(i) for i in ids),
        )

    def peek_after(self) -> Batch:
        """The batch after the next one, without advancing the stream (the driver plans it while a step runs)."""
        state = self.state_dict()
        self.next_batch()
        after = self.peek()
        self.load_state_dict(state)
        return after

    def next_batch(self) -> Batch:
        """Take the next batch and advance; a finished epoch rolls over to the next permutation."""
        batch = self.peek()
        self.position += len(batch.doc_ids)
        self.step += 1
        if self.position >= self.num_docs:
            self.epoch, self.position = self.epoch + 1, 0
        return batch

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """Plain JSON-able position of the stream (seed, epoch, position, step, num_docs, batch_size)."""
        return {k: int(getattr(self, k)) for k in _STATE_KEYS}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (from `state_dict()` of a stream over the same corpus size and batch size)."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"stream state lacks {missing}; expected the dict from DocumentStream.state_dict()")
        try:
            s = {k: int(state[k]) for k in _STATE_KEYS}
        except (TypeError, ValueError):
            raise ValueError(f"stream state values must be integers, got {state}") from None
        if s["num_docs"] != self.num_docs:
            raise ValueError(
                f"stream state was saved for a corpus of {s['num_docs']} documents, this stream has {self.num_docs}; "
                "resume with the same corpus (same source, tokenizer, max_context and filters)"
            )
        if s["batch_size"] != self.batch_size:
            raise ValueError(
                f"stream state was saved with batch_size {s['batch_size']}, this stream has {self.batch_size}; "
                "resume with the same batch size"
            )
        if s["epoch"] < 0 or s["step"] < 0 or not 0 <= s["position"] < self.num_docs:
            raise ValueError(f"stream state is out of range: {s} (position must lie in 0..{self.num_docs - 1})")
        if s["position"] % self.batch_size:
            raise ValueError(f"stream state position {s['position']} is not a multiple of batch_size {self.batch_size}")
        self.seed, self.epoch, self.position, self.step = s["seed"], s["epoch"], s["position"], s["step"]
        self._perm_epoch = None

    def __repr__(self) -> str:
        return (
            f"DocumentStream(num_docs={self.num_docs}, batch_size={self.batch_size}, seed={self.seed}, "
            f"epoch={self.epoch}, position={self.position}, step={self.step})"
        )
