"""The documents of several ``[[tasks]]`` as one corpus, and the per-task streams that fill each global batch.

Each task's source is loaded as a corpus of its own (``flexorch.data.corpus.load_corpus``, so every format and
record kind works per task); :func:`combine_corpora` puts them one after another in one id space (task t's documents
are ids ``first[t] .. first[t+1]-1``, its blocks follow the previous tasks' blocks) with ``Corpus.task_of``, so the
driver, the planner and the workers index one corpus, as in a run of one task, and each
:class:`~flexorch.work.step.DocRef` carries its task.

:class:`TaskStreams` draws every global batch as ``counts[t]`` documents of each task from the task's own
:class:`~flexorch.data.stream.DocumentStream` (its own seeded permutation, its own epochs): every document of a task
is seen exactly once per epoch of that task, whatever the other tasks' sizes (a small task simply runs more
epochs). Its state holds each task's stream position, so a resume continues every task at its exact next document.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from flexorch.data.corpus import Corpus
from flexorch.data.stream import Batch, BatchStream, DocumentStream

__all__ = ["TaskStreams", "combine_corpora", "load_task_corpus"]


def combine_corpora(corpora, names) -> Corpus:
    """One :class:`Corpus` over the tasks' corpora in order, with ``task_of`` and per-task ``stats["tasks"]``."""
    corpora, names = list(corpora), tuple(names)
    if not corpora or len(corpora) != len(names):
        raise ValueError(f"need one corpus per task, got {len(corpora)} corpora for tasks {names}")
    tok = {c.tokenizer_name for c in corpora}
    if len(tok) > 1:
        raise ValueError(f"the tasks' corpora were tokenized differently ({sorted(tok)}); tasks share one tokenizer")
    blocks_before = np.cumsum([0] + [len(c.blocks) for c in corpora])[:-1]
    targets = [c.targets if c.targets is not None else c.lengths - 1 for c in corpora]
    stats: dict = {"tasks": {n: c.stats for n, c in zip(names, corpora, strict=True)}}
    counted = {k for c in corpora for k, v in c.stats.items() if isinstance(v, int) and not isinstance(v, bool)}
    for key in sorted(counted - {"max_token_id"}):  # documents, tokens, split_docs, bad_records, ...: summed
        stats[key] = sum(int(c.stats.get(key, 0)) for c in corpora)
    stats["source"] = ", ".join(f"{n}: {c.stats.get('source')}" for n, c in zip(names, corpora, strict=True))
    stats["targets"] = int(sum(int(t.sum()) for t in targets))
    return Corpus(
        keys=[f"{n}/{k}" for n, c in zip(names, corpora, strict=True) for k in c.keys],  # small task corpora
        lengths=np.concatenate([np.asarray(c.lengths) for c in corpora]),
        doc_blocks=np.concatenate([c.doc_blocks + b for c, b in zip(corpora, blocks_before, strict=True)]),
        doc_offsets=np.concatenate([c.doc_offsets for c in corpora]),
        blocks=[r for c in corpora for r in c.blocks],
        stats=stats,
        tokenizer_name=corpora[0].tokenizer_name,
        vocab_size=max(c.vocab_size for c in corpora),
        targets=np.concatenate(targets) if any(c.targets is not None for c in corpora) else None,
        task_of=np.concatenate([np.full(c.num_docs, t, dtype=np.int32) for t, c in enumerate(corpora)]),
        task_names=names,
    )


def load_task_corpus(tasks, publish=None) -> Corpus:
    """Load every task's data (``TaskSettings.data``) and combine them; a task without a document is an error
    naming it (``load_corpus`` raises for an empty source)."""
    from flexorch.data.corpus import load_corpus
    from flexorch.data.errors import DataError

    corpora = []
    for t in tasks:
        say = None
        if publish is not None:
            say = lambda ev, name=t.name: publish({**ev, "message": f"[task {name}] {ev.get('message', '')}"})  # noqa: E731
        try:
            c = load_corpus(t.data, publish=say)
        except DataError as e:
            raise DataError(f"[[tasks]] {t.name!r}: {e}") from None
        if c.num_docs == 0:
            raise DataError(f"[[tasks]] {t.name!r}: its source {t.data.source!r} gave no document to train on")
        corpora.append(c)
    return combine_corpora(corpora, [t.name for t in tasks])


def _first_docs(task_of: np.ndarray, num_tasks: int) -> np.ndarray:
    counts = np.bincount(task_of, minlength=num_tasks)
    return np.concatenate([[0], np.cumsum(counts)])


class TaskStreams(BatchStream):
    """A :class:`~flexorch.data.stream.BatchStream` over several tasks: each batch is ``counts[t]`` documents of
    every task t (fewer at the end of that task's epoch), drawn from the task's own stream
    seeded ``[seed, t]``-style."""

    def __init__(self, corpus: Corpus, counts, seed: int = 0):
        if corpus.task_of is None:
            raise ValueError("TaskStreams needs a corpus of several tasks (combine_corpora)")
        self.names = corpus.task_names
        if len(counts) != len(self.names) or min(counts) < 1:
            raise ValueError(f"need a batch count >= 1 per task {self.names}, got {list(counts)}")
        self.first = _first_docs(corpus.task_of, len(self.names))
        sizes = np.diff(self.first)
        pairs = zip(sizes, counts, strict=True)
        self.streams = [DocumentStream(int(n), int(b), _task_seed(seed, t)) for t, (n, b) in enumerate(pairs)]
        self.step = 0

    @property
    def batch_size(self) -> int:
        return sum(s.batch_size for s in self.streams)

    @property
    def batches_per_epoch(self) -> int:
        """Batches until the task with the most batches per epoch has seen all its documents once."""
        return max(s.batches_per_epoch for s in self.streams)

    def _combine(self, batches: list[Batch]) -> Batch:
        ids = tuple(int(self.first[t]) + i for t, b in enumerate(batches) for i in b.doc_ids)
        lead = batches[0]  # the first task's epoch names the batch (each task's own is in the records' doc ids)
        return Batch(epoch=lead.epoch, index_in_epoch=lead.index_in_epoch, step=self.step, doc_ids=ids)

    def peek(self) -> Batch:
        return self._combine([s.peek() for s in self.streams])

    def peek_after(self) -> Batch:
        return dataclasses.replace(self._combine([s.peek_after() for s in self.streams]), step=self.step + 1)

    def next_batch(self) -> Batch:
        batch = self._combine([s.next_batch() for s in self.streams])
        self.step += 1
        return batch

    def task_epochs(self) -> dict[str, int]:
        """Each task's current epoch."""
        return {n: s.epoch for n, s in zip(self.names, self.streams, strict=True)}

    def state_dict(self) -> dict:
        """``{"step": N, "tasks": {name: DocumentStream state}}`` (plain JSON)."""
        return {"step": self.step, "tasks": {n: s.state_dict() for n, s in zip(self.names, self.streams, strict=True)}}

    def load_state_dict(self, state: dict) -> None:
        """Continue every task at its exact next document (the same tasks, in any order of the state's keys)."""
        got = state.get("tasks") if isinstance(state, dict) else None
        if not isinstance(got, dict) or set(got) != set(self.names):
            have = sorted(got) if isinstance(got, dict) else "no tasks (a run of one task)"
            raise ValueError(
                f"the stream state was saved for tasks {have}, this run has {sorted(self.names)}; resume with the "
                "same [[tasks]]"
            )
        for n, s in zip(self.names, self.streams, strict=True):
            try:
                s.load_state_dict(got[n])
            except ValueError as e:
                raise ValueError(f"[[tasks]] {n!r}: {e}") from None
        self.step = int(state["step"])


def _task_seed(seed: int, task: int) -> int:
    """Task 0 keeps the run's seed (a run of one task orders its data as a run without ``[[tasks]]``); the others
    get their own."""
    return int(seed) + 1_000_003 * task


def tasks_tokenizer(cfg, run_dir):
    """``cfg`` with its tokenizer ready for every task: a ``bpe:N`` is trained on the first task's data (or reused
    from ``run_dir``) and becomes the run's, shared by all tasks (``flexorch.data.bpe.prepare_tokenizer``)."""
    from flexorch.data.bpe import prepare_tokenizer

    spec = prepare_tokenizer(cfg.tasks[0].data, run_dir).tokenizer
    if spec == cfg.data.tokenizer:
        return cfg
    return cfg.replace(data=dataclasses.replace(cfg.data, tokenizer=spec))  # TrainConfig hands it to every task


def task_fields(tasks, docs, losses: dict, epochs: dict | None = None) -> dict:
    """A step record's ``tasks``: per task, its documents, tokens, loss-target tokens, mean loss and (``epochs``:
    :meth:`TaskStreams.task_epochs` when the batch was drawn) the task's own epoch."""
    out = {t.name: {"docs": 0, "tokens": 0, "targets": 0, "loss": losses.get(t.name)} for t in tasks}
    for name, epoch in (epochs or {}).items():
        out[name]["epoch"] = int(epoch)
    names = [t.name for t in tasks]
    for d in docs:
        entry = out[names[d.task]]
        entry["docs"] += 1
        entry["tokens"] += d.length
        entry["targets"] += d.predicted
    return out


MULTITASK_KEYS = ("multitask", "parts", "bound_ms", "makespan_ms", "gap", "simulated_ms", "dataflow_ms", "solve_s")


def multitask_fields(plan) -> dict:
    """A step record's ``multitask``: how the step's plan placed the tasks (``solver.multitask.execute``'s
    ``plan.meta``: the method, the parts as ``[task, first rank, devices, start ms, ms]``, Spindle's bound and
    makespan in its own cost model, the plan's simulated and barrier-free dataflow times)."""
    meta = getattr(plan, "meta", None) or {}
    return {k: meta[k] for k in MULTITASK_KEYS if k in meta}
