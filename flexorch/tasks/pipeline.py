"""What one worker runs in a pipelined step: plain, picklable values the driver builds from a staged plan.

:func:`pipeline_tasks` turns a ``flexorch.solver.pipeline.staged.StagedPlan`` into one :class:`PipelineTask` per rank: its
stage (or none: ranks left over when the workers do not divide into the stages sit the step out but take part in
the gradient all-reduce), the layers of that stage, and for every back-to-back pipeline the units and this stage's
op order and checkpointing. Pure (no torch, no Ray), so tests build the tasks of every rank in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flexorch.tasks.placement import holder_sets, placement
from flexorch.tasks.step import DocRef

__all__ = ["PipelineTask", "StagePipeline", "gradient_channels", "pipeline_tasks"]


@dataclass(frozen=True)
class StagePipeline:
    """One of the step's back-to-back pipelines as one stage runs it."""

    units: tuple
    """``flexorch.solver.pipeline.chunking.Unit`` of the pipeline (pieces of sequences; index = the unit number in ``ops``)."""
    ops: tuple[tuple[str, int], ...]
    """This stage's ops in order: ("F" | "B", unit)."""
    checkpointed: tuple[int, ...]
    """Layers of this stage run under activation checkpointing, per unit."""


@dataclass(frozen=True)
class PipelineTask:
    step: int
    rank: int
    world_size: int
    stage: int | None
    """This rank's stage, or None when it sits the step out."""
    stage_ranks: tuple[tuple[int, ...], ...]
    """World ranks of every stage; rank j of stage r sends to rank j of stage r + 1."""
    layers: tuple[int, ...]
    """Decoder layers of each stage."""
    pipelines: tuple[StagePipeline, ...]
    docs: tuple[DocRef, ...]
    """Every sequence of the batch (``Piece.seq`` indexes it)."""
    num_predicted: int
    stage_params: bool = False
    """Each rank holds only its stage's parameters (``flexorch.tasks.placement``); False: whole replicas."""
    tied: bool = False
    """The model ties its embedding and LM head (the first and the last stage both hold the embedding)."""

    def held_parts(self) -> list[frozenset[str]]:
        """The model parts each rank holds during this step (``stage_params``)."""
        return placement(self.stage_ranks, self.layers, self.world_size, self.tied)

    @property
    def rank_sets(self) -> tuple[tuple[int, ...], ...]:
        """Process groups every rank must create: the stages with more than one worker (SP inside a stage) and the
        neighbour pairs whose gradients travel on a group of their own (``flexorch.workers.pipeline.p2p``); with stage-local
        parameters also every other set of ranks holding one part."""
        sets = tuple(rs for rs in self.stage_ranks if len(rs) > 1) + tuple(gradient_channels(self.stage_ranks))
        if self.stage_params:  # parts held by more than a stage (a tied embedding) are summed over their holders
            sets += tuple(rs for rs, _ in holder_sets(self.held_parts()) if len(rs) > 1 and rs not in sets)
        return sets

    def blocks(self) -> set[int]:
        """Object-store blocks this rank reads."""
        return {d.block for d in self.docs} if self.stage is not None else set()


def gradient_channels(stage_ranks: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """The rank pairs ``(rank j of stage r, rank j of stage r + 1)`` whose gradient messages travel on a process
    group of their own (activations travel on the world); every rank must create these groups."""
    pairs = []
    for here, there in zip(stage_ranks, stage_ranks[1:], strict=False):
        pairs += [(int(a), int(b)) for a, b in zip(here, there, strict=True)]
    return pairs


def pipeline_tasks(
    staged, docs: Sequence[DocRef], step: int, *, stage_params: bool = False, tied: bool = False
) -> list[PipelineTask]:
    """One task per rank of ``staged`` (a ``StagedPlan``); ``docs[i]`` is sequence ``i`` of the batch."""
    lengths = [
        sum(p.end - p.start for u in staged.plan.units for p in u.pieces if p.seq == i) for i in range(len(docs))
    ]
    for i, (doc, s) in enumerate(zip(docs, lengths, strict=True)):
        if doc.length != s:
            raise ValueError(
                f"sequence {i}: the pipeline plan covers {s} tokens, document {doc.doc_id} has {doc.length}"
            )
    n = staged.num_devices
    stage_of = {r: s for s, rs in enumerate(staged.stage_ranks) for r in rs}
    num_predicted = sum(d.length - 1 for d in docs)
    tasks = []
    for rank in range(n):
        st = stage_of.get(rank)
        pipes = ()
        if st is not None:
            pipes = tuple(
                StagePipeline(p.units, tuple((op.kind, op.unit) for op in p.schedule[st]), tuple(p.checkpointed[st]))
                for p in staged.plan.pipelines
            )
        tasks.append(
            PipelineTask(
                step,
                rank,
                n,
                st,
                tuple(tuple(rs) for rs in staged.stage_ranks),
                tuple(staged.layers),
                pipes,
                tuple(docs),
                num_predicted,
                stage_params,
                tied,
            )
        )
    return tasks
