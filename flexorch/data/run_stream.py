"""Which stream of global batches a run reads: :func:`open_stream` picks the kind from the run's config, so the
driver holds one :class:`~flexorch.data.stream.BatchStream` and never branches on the kind of run."""

from __future__ import annotations

from flexorch.data.corpus import Corpus
from flexorch.data.mixture import MixtureStream
from flexorch.data.stream import BatchStream, DocumentStream
from flexorch.data.task_corpus import TaskStreams

__all__ = ["open_stream"]


def open_stream(cfg, corpus: Corpus) -> BatchStream:
    """The stream of a run (``cfg``: its ``TrainConfig``) over its ``corpus``: ``[[tasks]]``, each batch
    ``cfg.task_counts[t]`` documents of every task, each task on its own epochs; ``[[data.sources]]``, each batch
    blended from the sources by their weights, each source on its own epochs; else one :class:`DocumentStream` over
    the corpus."""
    if cfg.tasks:
        return TaskStreams(corpus, cfg.task_counts, cfg.seed)
    if cfg.data.sources:
        return MixtureStream.for_corpus(corpus, cfg.batch_size, cfg.seed)
    return DocumentStream(corpus.num_docs, cfg.batch_size, cfg.seed)
