"""Global batches of document ids: epoch-exact, seeded, resumable. Pure numpy, no Ray.

Every epoch is a seeded permutation of all document ids cut into consecutive slices of `batch_size`; the last slice
of an epoch may be smaller. Every document is used exactly once per epoch, none is dropped or repeated. An epoch's
order depends only on the seed and the epoch number:

* ``order="feistel"`` (the default): the id at position p of epoch e is
  ``feistel_permute(p, num_docs, derive_key(seed, e))`` (``flexorch.data.feistel``: a keyed Feistel bijection of
  ``[0, num_docs)`` with cycle-walking), computed per batch: O(1) memory, O(batch) time per batch, whatever the
  corpus size (10**9 documents are shuffled without a permutation array).
* ``order="rng"`` (legacy): ``np.random.default_rng([seed, epoch]).permutation(num_docs)``, the order of a saved
  stream state without an ``"order"`` key; it materialises the whole epoch (O(num_docs) memory and time per epoch).
  A state without an ``"order"`` key (saved by such a stream) resumes in this order, so an old run continues
  exactly as it would have.

The driver calls `peek()` to plan step t+1 while step t runs, then `next_batch()` to take it. `state_dict()` is a
plain JSON-able dict of a few ints and the order's name; `load_state_dict()` continues at exactly the next document.

:class:`BatchStream` is what the driver reads of any run's stream: this one, a mixture of sources
(``flexorch.data.mixture.MixtureStream``) or several tasks (``flexorch.data.task_corpus.TaskStreams``); each
answers every member, the per-kind ones (``task_epochs``, ``sources``) with None where they do not apply, so the
driver never asks which kind it holds. ``flexorch.data.run_stream.open_stream`` picks the kind from the run's
config.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np

from flexorch.data.feistel import derive_key, feistel_permute

__all__ = ["ORDERS", "Batch", "BatchStream", "DocumentStream"]

_STATE_KEYS = ("seed", "epoch", "position", "step", "num_docs", "batch_size")
ORDERS = ("feistel", "rng")
"""Epoch orders: ``"feistel"`` (default, O(batch) per batch) and ``"rng"`` (legacy, a numpy permutation)."""
_LEGACY_ORDER = "rng"  # the order of a state without an "order" key


def _check_order(order) -> str:
    if order not in ORDERS:
        raise ValueError(f"unknown stream order {order!r}; expected one of {list(ORDERS)}")
    return order


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


class BatchStream(abc.ABC):
    """A resumable stream of global batches: what the driver plans, takes and checkpoints (the module doc)."""

    batch_size: int
    """Documents in a full global batch."""

    @property
    @abc.abstractmethod
    def batches_per_epoch(self) -> int:
        """Batches in one epoch (of the kind's own notion of an epoch; the run summary reports it)."""

    @abc.abstractmethod
    def peek(self) -> Batch:
        """The next batch, without advancing the stream."""

    @abc.abstractmethod
    def peek_after(self) -> Batch:
        """The batch after the next one, without advancing the stream (the driver plans it while a step runs)."""

    @abc.abstractmethod
    def next_batch(self) -> Batch:
        """Take the next batch and advance."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """Plain JSON-able position of the stream (what a checkpoint saves)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Continue exactly at the next document of ``state`` (from ``state_dict()`` of the same kind of stream);
        a state of another kind or size is a ValueError that says how to resume."""

    def task_epochs(self) -> dict[str, int] | None:
        """``[[tasks]]``: each task's current epoch (a step record's ``tasks[name].epoch``); None otherwise."""
        return None

    def sources(self, batch: Batch, lengths) -> dict | None:
        """``[[data.sources]]``: what ``batch`` took from each source (a step record's ``sources``: documents,
        tokens, epoch per source; ``lengths``: the corpus's per-document lengths); None otherwise."""
        return None

    def __iter__(self):
        while True:
            yield self.next_batch()


class DocumentStream(BatchStream):
    """Seeded, epoch-exact stream of global batches over `num_docs` documents."""

    def __init__(self, num_docs: int, batch_size: int, seed: int = 0, *, order: str = "feistel"):
        if int(num_docs) < 1:
            raise ValueError(f"num_docs must be >= 1, got {num_docs} (the corpus is empty)")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.num_docs, self.batch_size, self.seed = int(num_docs), int(batch_size), int(seed)
        self.order = _check_order(order)
        self.epoch, self.position, self.step = 0, 0, 0
        self._perms: dict[tuple[int, int], np.ndarray] = {}  # "rng": (seed, epoch) -> permutation, at most 2
        self._batches: dict[tuple, np.ndarray] = {}  # (order, seed, epoch, position) -> ids: peek, peek_after

    @property
    def batches_per_epoch(self) -> int:
        """Batches in one epoch (the last one may be smaller than batch_size)."""
        return -(-self.num_docs // self.batch_size)

    def _rng_permutation(self, epoch: int) -> np.ndarray:
        key = (self.seed, int(epoch))
        if key not in self._perms:  # two kept: peek and peek_after straddle an epoch's end
            while len(self._perms) >= 2:
                del self._perms[next(iter(self._perms))]
            self._perms[key] = np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_docs)
        return self._perms[key]

    def epoch_ids(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Document ids at positions ``start .. stop-1`` of ``epoch``'s order (O(stop - start) for "feistel")."""
        start, stop = max(0, int(start)), min(self.num_docs, int(stop))
        if self.order == "rng":
            return self._rng_permutation(epoch)[start:stop].copy()  # no view keeps a whole epoch alive
        if stop <= start:
            return np.zeros(0, dtype=np.int64)
        return feistel_permute(np.arange(start, stop, dtype=np.int64), self.num_docs, derive_key(self.seed, epoch))

    def permutation(self, epoch: int) -> np.ndarray:
        """The whole order of document ids in `epoch` (a function of seed and epoch only); O(num_docs) memory, for
        tests and small corpora: the stream itself computes only the batch at hand."""
        return self.epoch_ids(epoch, 0, self.num_docs)

    def _batch_at(self, epoch: int, position: int, step: int) -> Batch:
        key = (self.order, self.seed, epoch, position)
        ids = self._batches.get(key)
        if ids is None:  # the driver peeks, peeks after and takes each batch: computed once, two kept
            ids = self.epoch_ids(epoch, position, position + self.batch_size)
            while len(self._batches) >= 2:
                del self._batches[next(iter(self._batches))]
            self._batches[key] = ids
        return Batch(epoch=epoch, index_in_epoch=position // self.batch_size, step=step, doc_ids=tuple(ids.tolist()))

    def _advance(self, epoch: int, position: int) -> tuple[int, int]:
        """(epoch, position) after the batch at (epoch, position); a finished epoch rolls over to the next."""
        position += min(self.batch_size, self.num_docs - position)
        return (epoch + 1, 0) if position >= self.num_docs else (epoch, position)

    def peek(self) -> Batch:
        """The next batch, without advancing the stream."""
        return self._batch_at(self.epoch, self.position, self.step)

    def peek_after(self) -> Batch:
        """The batch after the next one, without advancing the stream (the driver plans it while a step runs)."""
        epoch, position = self._advance(self.epoch, self.position)
        return self._batch_at(epoch, position, self.step + 1)

    def next_batch(self) -> Batch:
        """Take the next batch and advance; a finished epoch rolls over to the next permutation."""
        batch = self.peek()
        self.epoch, self.position = self._advance(self.epoch, self.position)
        self.step += 1
        return batch

    def state_dict(self) -> dict[str, int | str]:
        """Plain JSON-able position of the stream (seed, epoch, position, step, num_docs, batch_size, order)."""
        return {**{k: int(getattr(self, k)) for k in _STATE_KEYS}, "order": self.order}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (from `state_dict()` of a stream over the same corpus size and batch size).

        The state's order wins over this stream's; a state without one continues in the legacy ``"rng"``
        order, and this stream's later states say so."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"stream state lacks {missing}; expected the dict from DocumentStream.state_dict()")
        try:
            s = {k: int(state[k]) for k in _STATE_KEYS}
        except (TypeError, ValueError):
            raise ValueError(f"stream state values must be integers, got {state}") from None
        order = _check_order(state.get("order", _LEGACY_ORDER))
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
        self.order = order

    def __repr__(self) -> str:
        return (
            f"DocumentStream(num_docs={self.num_docs}, batch_size={self.batch_size}, seed={self.seed}, "
            f"order={self.order!r}, epoch={self.epoch}, position={self.position}, step={self.step})"
        )
