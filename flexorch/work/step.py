"""What one worker runs in one step: plain, picklable values the driver builds from a `Plan` (no torch, no Ray).

The driver turns the step's plan into one :class:`StepWork` per rank with :func:`step_work`; a worker only sees
its own groups and the token locations of their documents (blocks of the prepared store), never the whole batch. The
function is pure, so tests call it for every rank of a plan in one process. Every value checks itself on
construction (a malformed value fails in the driver, naming the numbers, not on a worker inside a collective).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "DocRef",
    "GroupWork",
    "StepWork",
    "step_work",
    "check_count",
    "check_ranks",
    "hybrid_sub_groups",
    "sp_rank_sets",
]

KINDS = ("ulysses", "ring")
"""The one-dimensional SP attention kinds (``flexorch.solver.cost_model.KINDS``)."""
HYBRID = "hybrid"
GROUP_KINDS = (*KINDS, HYBRID)
"""Every kind a group runs (``flexorch.solver.cost_model.GROUP_KINDS``)."""


def _is_count(value, minimum: int = 0) -> bool:
    """Whether ``value`` is an int (not a bool) >= ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_count(what: str, value, minimum: int = 0) -> None:
    """Raise ValueError unless ``value`` is an int (not a bool) >= ``minimum``, naming ``what`` and the value."""
    if not _is_count(value, minimum):
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}")


def check_ranks(what: str, ranks, world_size: int | None = None) -> None:
    """Raise ValueError unless ``ranks`` is a non-empty tuple of distinct ranks (in ``0 .. world_size - 1``)."""
    if not isinstance(ranks, tuple) or not ranks:
        raise ValueError(f"{what} must be a non-empty tuple of ranks, got {ranks!r}")
    for r in ranks:
        check_count(f"{what}: rank", r)
    bad = [r for r in ranks if world_size is not None and r >= world_size]
    if bad:
        raise ValueError(f"{what} {ranks}: rank {bad[0]} is outside the world of {world_size} ranks")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{what} {ranks} names a rank twice")


def hybrid_sub_groups(ranks: tuple[int, ...], u: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(Ulysses block, ring) of ``rank`` in a hybrid group on ``ranks`` with Ulysses degree ``u``: ring position
    ``j`` runs on ``ranks[j*u:(j+1)*u]``, so group rank ``g = j*u + i`` all-to-alls with its block and rings with
    ``ranks[i::u]``, the ranks at its offset in every block (``flexorch.workers.attention.hybrid``)."""
    g = ranks.index(rank)
    j, i = divmod(g, u)
    return ranks[j * u : (j + 1) * u], ranks[i::u]


def sp_rank_sets(groups) -> list[tuple[int, ...]]:
    """The process groups a step's SP groups (``ranks``, ``kind``, ``ulysses_degree`` each) need, every rank the
    same list, smallest first: every Ulysses or ring group of degree > 1, and a hybrid group's Ulysses blocks and
    rings (its attention runs on those alone: the whole group needs no communicator of its own)."""
    sets = set()
    for g in groups:
        ranks = tuple(g.ranks)
        if g.kind == HYBRID:
            u = g.ulysses_degree  # every member's (block, ring) of hybrid_sub_groups, each set named once
            sets |= {ranks[j : j + u] for j in range(0, len(ranks), u)} | {ranks[i::u] for i in range(u)}
        elif len(ranks) > 1:
            sets.add(ranks)
    return sorted(sets, key=lambda r: (len(r), r))


@functools.lru_cache(maxsize=4)
def _rank_set_index(rank_sets: tuple[tuple[int, ...], ...], world_size: int) -> frozenset:
    """``rank_sets`` checked against the world, as a set: every rank of a step holds the same value, so the check
    runs once per step and not once per rank (a check per rank grows with the world's size squared)."""
    for rs in rank_sets:
        check_ranks("rank set", rs, world_size)
    return frozenset(rank_sets)


@dataclass(frozen=True)
class DocRef:
    """Where one document's tokens live: ``blocks[block][offset : offset + length]``."""

    doc_id: int
    """Corpus document id (for the ledger)."""
    block: int
    """Index of the corpus block holding the tokens (``Corpus.blocks``, ``flexorch.data.store.blocks``)."""
    offset: int
    """First token inside the block."""
    length: int
    """Tokens of the document."""
    targets: int | None = None
    """Tokens that carry loss (predicted from the ones before them; ``flexorch.data.targets``); None: every token
    after the first (``length - 1``, plain text)."""
    task: int = 0
    """Index of the ``[[tasks]]`` task the document belongs to (0 in a run of one task): the adapter its tokens run
    through and the weight of their loss."""

    def __post_init__(self) -> None:
        t = self.targets
        valid = _is_count(self.doc_id) and _is_count(self.block) and _is_count(self.offset) and _is_count(self.task)
        if valid and _is_count(self.length, 1) and (t is None or (_is_count(t) and t <= self.length - 1)):
            return  # a batch makes thousands: the messages below are built only for a malformed one
        for name in ("doc_id", "block", "offset", "task"):
            check_count(f"DocRef.{name} (document {self.doc_id!r})", getattr(self, name))
        check_count(f"DocRef.length (document {self.doc_id})", self.length, 1)
        if self.targets is not None:
            check_count(f"DocRef.targets (document {self.doc_id})", self.targets)
            if self.targets > self.length - 1:
                raise ValueError(
                    f"DocRef.targets (document {self.doc_id}) is {self.targets}, more than its {self.length - 1} "
                    "predicted positions"
                )

    @property
    def predicted(self) -> int:
        """Tokens whose prediction counts in the loss: the document's share of the step's loss denominator."""
        return self.length - 1 if self.targets is None else self.targets


@dataclass(frozen=True)
class GroupWork:
    """This rank's part of one SP group in one micro-batch."""

    micro_batch: int
    """Index of the micro-batch in the step (micro-batches run in order)."""
    ranks: tuple[int, ...]
    """The group's ranks in the current world; this rank is one of them."""
    kind: str
    """'ulysses', 'ring' (irrelevant for degree 1) or 'hybrid' (Ulysses inside blocks of ``ulysses_degree``
    consecutive ranks, zigzag ring across them)."""
    docs: tuple[DocRef, ...]
    """The group's documents in plan order (every member holds the same list and shards it)."""
    recompute: str | None = None
    """'none', 'selective' or 'full': the activation checkpointing this group runs this micro-batch with (every
    member the same: a recompute runs the group's collectives again); None: the model's own mode."""
    ulysses_degree: int | None = None
    """A hybrid group's Ulysses degree u (``flexorch.solver.plan.Group.ulysses_degree``); None otherwise."""

    def __post_init__(self) -> None:
        check_count("GroupWork.micro_batch", self.micro_batch)
        if self.recompute not in (None, "none", "selective", "full"):
            raise ValueError(
                f"GroupWork (micro-batch {self.micro_batch}) recompute must be 'none', 'selective', 'full' or None"
            )
        check_ranks(f"GroupWork (micro-batch {self.micro_batch}) ranks", self.ranks)
        d = len(self.ranks)
        if d & (d - 1):
            raise ValueError(
                f"GroupWork (micro-batch {self.micro_batch}) ranks {self.ranks}: degree {d} is not a power of two"
            )
        if self.kind not in GROUP_KINDS:
            raise ValueError(
                f"GroupWork (micro-batch {self.micro_batch}) kind must be one of {GROUP_KINDS}, got {self.kind!r}"
            )
        u = self.ulysses_degree
        if (self.kind == HYBRID) != (u is not None) or (u is not None and (u < 2 or d % u or d // u < 2)):
            raise ValueError(
                f"GroupWork (micro-batch {self.micro_batch}) on ranks {self.ranks}: a hybrid group needs a "
                f"ulysses_degree u with 2 <= u, u | {d} and {d} / u >= 2, and only a hybrid group names one; "
                f"got kind {self.kind!r}, ulysses_degree {u!r}"
            )
        if not isinstance(self.docs, tuple) or not all(isinstance(doc, DocRef) for doc in self.docs):
            raise ValueError(f"GroupWork (micro-batch {self.micro_batch}) docs must be a tuple of DocRef")
        if len({doc.task for doc in self.docs}) > 1:
            raise ValueError(
                f"GroupWork (micro-batch {self.micro_batch}) on ranks {self.ranks} mixes documents of tasks "
                f"{sorted({doc.task for doc in self.docs})}; a group runs one task's adapter"
            )

    @property
    def task(self) -> int:
        """The ``[[tasks]]`` task of the group's documents (0 in a run of one task)."""
        return self.docs[0].task if self.docs else 0

    @property
    def degree(self) -> int:
        return len(self.ranks)

    @functools.cached_property
    def predicted(self) -> int:
        """Loss-target tokens of the group's documents (summed once: every member's :class:`StepWork` checks it)."""
        return sum(d.predicted for d in self.docs)


@dataclass(frozen=True)
class StepWork:
    """One rank's whole step."""

    step: int
    """Global step number (0-based)."""
    rank: int
    """This worker's rank in the current world."""
    world_size: int
    """Workers in the current world."""
    rank_sets: tuple[tuple[int, ...], ...]
    """The process groups all ranks must create (collectively) for the plan's SP groups (:func:`sp_rank_sets`): every
    Ulysses or ring group of degree > 1, each hybrid group's Ulysses blocks and rings."""
    work: tuple[GroupWork, ...]
    """This rank's groups, in micro-batch order (empty when the plan leaves it idle)."""
    num_predicted: int
    """Loss-target tokens of the whole global batch (``DocRef.predicted`` summed): the loss denominator, identical
    on every rank."""
    micro_batches: int = 0
    """Micro-batches of the whole step; with sharded model state every rank runs each one (an empty one where it
    has no group), since FSDP's gathers span the world. 0: not given (whole replicas only need their own)."""
    task_names: tuple[str, ...] = ()
    """The run's ``[[tasks]]`` in order (the adapter each group activates); empty: one task, no adapters."""
    task_weights: tuple[float, ...] = ()
    """Each task's weight in the loss, normalised to sum to 1 (``[[tasks]] weight``)."""
    task_predicted: tuple[int, ...] = ()
    """Each task's loss-target tokens in the whole global batch (they sum to ``num_predicted``)."""

    def __post_init__(self) -> None:
        check_count("StepWork.step", self.step)
        check_count(f"StepWork (step {self.step}) micro_batches", self.micro_batches)
        check_count(f"StepWork (step {self.step}) world_size", self.world_size, 1)
        check_count(f"StepWork (step {self.step}) rank", self.rank)
        if self.rank >= self.world_size:
            raise ValueError(f"StepWork (step {self.step}): rank {self.rank} is outside the world of {self.world_size}")
        check_count(f"StepWork (step {self.step}) num_predicted", self.num_predicted)
        where = f"StepWork (step {self.step}, rank {self.rank})"
        try:
            sets = _rank_set_index(tuple(self.rank_sets), self.world_size)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        except TypeError:  # an unhashable rank set (not a tuple): the check says which
            for rs in self.rank_sets:
                check_ranks(f"{where}: rank set", rs, self.world_size)
            raise
        last = -1
        for w in self.work:
            if not isinstance(w, GroupWork):
                raise ValueError(f"{where}: work must hold GroupWork values, got {type(w).__name__}")
            if max(w.ranks) >= self.world_size:  # the group checked its ranks; the world's bound is checked here
                check_ranks(f"{where}: micro-batch {w.micro_batch} group", w.ranks, self.world_size)
            if self.rank not in w.ranks:
                raise ValueError(
                    f"{where}: micro-batch {w.micro_batch} group {w.ranks} does not include rank {self.rank}"
                )
            if w.micro_batch <= last:
                raise ValueError(
                    f"{where}: work must be in micro-batch order, one group each; micro-batch {w.micro_batch} "
                    f"follows {last}"
                )
            missing = sorted(set(sp_rank_sets([w])) - sets)  # the group, and a hybrid group's sub-groups
            if missing:
                what = "is" if missing == [w.ranks] else f"needs {missing},"
                raise ValueError(f"{where}: micro-batch {w.micro_batch} group {w.ranks} {what} not in rank_sets")
            predicted = w.predicted
            if predicted > self.num_predicted:
                raise ValueError(
                    f"{where}: micro-batch {w.micro_batch} alone predicts {predicted} tokens, more than the batch's "
                    f"num_predicted {self.num_predicted}"
                )
            last = w.micro_batch
        k = len(self.task_names)
        if (len(self.task_weights), len(self.task_predicted)) != (k, k):
            raise ValueError(
                f"{where}: task_weights {self.task_weights} and task_predicted {self.task_predicted} need one entry "
                f"per task of {self.task_names}"
            )
        if k and sum(self.task_predicted) != self.num_predicted:
            raise ValueError(
                f"{where}: the tasks' targets {self.task_predicted} do not sum to num_predicted {self.num_predicted}"
            )
        bad = [w.task for w in self.work if w.task >= max(k, 1)]
        if bad:
            raise ValueError(f"{where}: a group runs task {bad[0]}, the run has tasks {self.task_names or ('one',)}")
        if self.micro_batches and last >= self.micro_batches:
            raise ValueError(f"{where}: micro-batch {last} is outside the step's {self.micro_batches} micro-batches")

    def loss_scale(self, t: int) -> float:
        """What a group of task ``t`` multiplies its summed loss by, so that after the world's division by
        ``num_predicted`` the step's loss is ``sum_t weight_t * (task t's summed loss / task t's targets)``; 1.0 in a
        run of one task (every token weighs the same)."""
        if not self.task_names:
            return 1.0
        n_t = self.task_predicted[t]
        return self.task_weights[t] * self.num_predicted / n_t if n_t else 0.0

    def blocks(self) -> set[int]:
        """Corpus blocks this rank reads (their specs: ``Corpus.block_specs``)."""
        return {d.block for w in self.work for d in w.docs}


def step_work(
    plan, docs: Sequence[DocRef], step: int, recompute=None, task_names=(), task_weights=()
) -> list[StepWork]:
    """One :class:`StepWork` per rank of ``plan``; ``docs[i]`` is the plan's sequence ``i``.

    ``plan`` is a ``solver.plan.Plan`` whose ``seq_lengths`` must equal the documents' lengths. ``recompute``
    (``[sharding] activation_checkpointing = "auto"``): per micro-batch, each group's mode, in the plan's order.
    """
    if len(docs) != len(plan.seq_lengths):
        raise ValueError(f"plan has {len(plan.seq_lengths)} sequences, got {len(docs)} documents")
    for i, (doc, s) in enumerate(zip(docs, plan.seq_lengths, strict=True)):
        if doc.length != s:
            raise ValueError(f"sequence {i}: plan says {s} tokens, document {doc.doc_id} has {doc.length}")
    n = plan.num_devices
    rank_sets = sp_rank_sets(g for mb in plan.micro_batches for g in mb.groups)
    per_rank: list[list[GroupWork]] = [[] for _ in range(n)]
    for mi, mb in enumerate(plan.micro_batches):
        for gi, g in enumerate(mb.groups):
            mode = recompute[mi][gi] if recompute is not None else None
            work = GroupWork(
                mi, tuple(g.ranks), g.kind, tuple(docs[i] for i in g.seq_ids), mode, ulysses_degree=g.ulysses_degree
            )
            for r in g.ranks:
                per_rank[r].append(work)
    num_predicted = sum(d.predicted for d in docs)
    m = len(plan.micro_batches)
    names = tuple(task_names)
    weights: tuple[float, ...] = ()
    per_task: tuple[int, ...] = ()
    if names:
        if len(task_weights) != len(names) or min(task_weights) <= 0:
            raise ValueError(f"need a weight > 0 per task of {names}, got {list(task_weights)}")
        total = float(sum(task_weights))
        weights = tuple(float(w) / total for w in task_weights)
        counts = [0] * len(names)
        for d in docs:
            counts[d.task] += d.predicted
        per_task = tuple(counts)
    return [
        StepWork(step, r, n, tuple(rank_sets), tuple(per_rank[r]), num_predicted, m, names, weights, per_task)
        for r in range(n)
    ]
