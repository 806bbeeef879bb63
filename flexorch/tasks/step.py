"""What one worker runs in one step: plain, picklable values the driver builds from a `Plan` (no torch, no Ray).

The driver turns the step's plan into one :class:`StepTask` per rank with :func:`step_tasks`; a worker only sees
its own groups and the token locations of their documents (object-store blocks), never the whole batch. The
function is pure, so tests call it for every rank of a plan in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DocRef", "GroupWork", "StepTask", "step_tasks"]


@dataclass(frozen=True)
class DocRef:
    """Where one document's tokens live: ``blocks[block][offset : offset + length]``."""

    doc_id: int
    """Corpus document id (for the ledger)."""
    block: int
    """Index of the object-store block holding the tokens."""
    offset: int
    """First token inside the block."""
    length: int
    """Tokens of the document."""


@dataclass(frozen=True)
class GroupWork:
    """This rank's part of one SP group in one micro-batch."""

    micro_batch: int
    """Index of the micro-batch in the step (micro-batches run in order)."""
    ranks: tuple[int, ...]
    """The group's ranks in the current world; this rank is one of them."""
    kind: str
    """'ulysses' or 'ring' (irrelevant for degree 1)."""
    docs: tuple[DocRef, ...]
    """The group's documents in plan order (every member holds the same list and shards it)."""

    @property
    def degree(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class StepTask:
    """One rank's whole step."""

    step: int
    """Global step number (0-based)."""
    rank: int
    """This worker's rank in the current world."""
    world_size: int
    """Workers in the current world."""
    rank_sets: tuple[tuple[int, ...], ...]
    """Every SP group of degree > 1 in the plan: the process groups all ranks must create (collectively)."""
    work: tuple[GroupWork, ...]
    """This rank's groups, in micro-batch order (empty when the plan leaves it idle)."""
    num_predicted: int
    """Predicted tokens of the whole global batch: the loss denominator, identical on every rank."""

    def blocks(self) -> set[int]:
        """Object-store blocks this rank reads."""
        return {d.block for w in self.work for d in w.docs}


def step_tasks(plan, docs: Sequence[DocRef], step: int) -> list[StepTask]:
    """One :class:`StepTask` per rank of ``plan``; ``docs[i]`` is the plan's sequence ``i``.

    ``plan`` is a ``solver.plan.Plan`` whose ``seq_lengths`` must equal the documents' lengths.
    """
    if len(docs) != len(plan.seq_lengths):
        raise ValueError(f"plan has {len(plan.seq_lengths)} sequences, got {len(docs)} documents")
    for i, (doc, s) in enumerate(zip(docs, plan.seq_lengths, strict=True)):
        if doc.length != s:
            raise ValueError(f"sequence {i}: plan says {s} tokens, document {doc.doc_id} has {doc.length}")
    n = plan.num_devices
    rank_sets = sorted(
        {tuple(g.ranks) for mb in plan.micro_batches for g in mb.groups if g.degree > 1}, key=lambda r: (len(r), r)
    )
    per_rank: list[list[GroupWork]] = [[] for _ in range(n)]
    for mi, mb in enumerate(plan.micro_batches):
        for g in mb.groups:
            work = GroupWork(mi, tuple(g.ranks), g.kind, tuple(docs[i] for i in g.seq_ids))
            for r in g.ranks:
                per_rank[r].append(work)
    num_predicted = sum(d.length - 1 for d in docs)
    return [StepTask(step, r, n, tuple(rank_sets), tuple(per_rank[r]), num_predicted) for r in range(n)]
