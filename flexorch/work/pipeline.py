"""What one worker runs in a pipelined step: plain, picklable values the driver builds from a staged plan.

:func:`pipeline_work` turns a ``flexorch.solver.pipeline.staged.StagedPlan`` into one :class:`PipelineWork` per rank:
its stage (or none: ranks left over when the workers do not divide into the stages sit the step out but take part in the
gradient all-reduce), the layers of that stage, and for every back-to-back pipeline the units and this stage's op order
and checkpointing. Pure (no torch, no Ray), so tests build the work of every rank in one process. Both values check
themselves on construction, naming the numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flexorch.work.placement import holder_sets, placement
from flexorch.work.step import DocRef, check_count, check_ranks

__all__ = ["PipelineWork", "StagePipeline", "gradient_channels", "pipeline_work"]


@dataclass(frozen=True)
class StagePipeline:
    """One of the step's back-to-back pipelines as one stage runs it."""

    units: tuple
    """``flexorch.solver.pipeline.chunking.Unit`` of the pipeline (pieces of sequences; index = the unit number in
    ``ops``)."""
    ops: tuple[tuple[str, int], ...]
    """This stage's ops in order: ("F" | "B", unit)."""
    checkpointed: tuple[int, ...]
    """Layers of this stage run under activation checkpointing, per unit."""

    def __post_init__(self) -> None:
        n = len(self.units)
        if len(self.checkpointed) != n:
            raise ValueError(f"StagePipeline: {len(self.checkpointed)} checkpointing entries for {n} units")
        for c in self.checkpointed:
            check_count("StagePipeline: checkpointed layers of a unit", c)
        seen: dict[tuple[str, int], int] = {}
        for kind, unit in self.ops:
            if kind not in ("F", "B") or isinstance(unit, bool) or not isinstance(unit, int) or not 0 <= unit < n:
                raise ValueError(f"StagePipeline: op ({kind!r}, {unit!r}) is not ('F' | 'B', a unit in 0..{n - 1})")
            if (kind, unit) in seen:
                raise ValueError(f"StagePipeline: op ({kind!r}, {unit}) appears twice")
            if kind == "B" and ("F", unit) not in seen:
                raise ValueError(f"StagePipeline: the backward of unit {unit} comes before its forward")
            seen[(kind, unit)] = len(seen)
        if len(seen) != 2 * n:
            missing = sorted({(k, u) for k in "FB" for u in range(n)} - set(seen))
            raise ValueError(f"StagePipeline: {n} units need {2 * n} ops, got {len(seen)} (missing {missing[:4]})")


@dataclass(frozen=True)
class PipelineWork:
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
    """Each rank holds only its stage's parameters (``flexorch.work.placement``); False: whole replicas."""
    tied: bool = False
    """The model ties its embedding and LM head (the first and the last stage both hold the embedding)."""

    def __post_init__(self) -> None:
        check_count("PipelineWork.step", self.step)
        check_count(f"PipelineWork (step {self.step}) world_size", self.world_size, 1)
        check_count(f"PipelineWork (step {self.step}) rank", self.rank)
        where = f"PipelineWork (step {self.step}, rank {self.rank})"
        if self.rank >= self.world_size:
            raise ValueError(f"{where}: rank {self.rank} is outside the world of {self.world_size}")
        if not self.stage_ranks:
            raise ValueError(f"{where}: stage_ranks names no stage")
        for r, ranks in enumerate(self.stage_ranks):
            check_ranks(f"{where}: stage {r} ranks", ranks, self.world_size)
        sizes = sorted({len(rs) for rs in self.stage_ranks})
        if len(sizes) > 1:
            raise ValueError(f"{where}: stages of {sizes} ranks; every stage needs the same number of ranks")
        flat = [r for rs in self.stage_ranks for r in rs]
        if len(set(flat)) != len(flat):
            raise ValueError(f"{where}: stage_ranks {self.stage_ranks} put a rank on two stages")
        p = len(self.stage_ranks)
        if len(self.layers) != p:
            raise ValueError(f"{where}: {len(self.layers)} layer counts for {p} stages")
        for r, n in enumerate(self.layers):
            check_count(f"{where}: layers of stage {r}", n, 1)
        if self.stage is None:
            if self.rank in flat:
                raise ValueError(f"{where}: rank {self.rank} is on a stage, but stage is None")
            if self.pipelines:
                raise ValueError(f"{where}: a rank on no stage runs no pipeline, got {len(self.pipelines)}")
        else:
            check_count(f"{where}: stage", self.stage)
            if self.stage >= p:
                raise ValueError(f"{where}: stage {self.stage} of {p} stages")
            if self.rank not in self.stage_ranks[self.stage]:
                raise ValueError(
                    f"{where}: rank {self.rank} is not on stage {self.stage} {self.stage_ranks[self.stage]}"
                )
            most = self.layers[self.stage]
            for pipe in self.pipelines:
                over = [c for c in pipe.checkpointed if c > most]
                if over:
                    raise ValueError(f"{where}: {over[0]} checkpointed layers on stage {self.stage} of {most} layers")
        if not all(isinstance(d, DocRef) for d in self.docs):
            raise ValueError(f"{where}: docs must be DocRef values")
        want = sum(d.predicted for d in self.docs)
        if self.num_predicted != want:
            raise ValueError(
                f"{where}: num_predicted is {self.num_predicted}, the {len(self.docs)} documents predict {want} tokens"
            )

    def held_parts(self) -> list[frozenset[str]]:
        """The model parts each rank holds during this step (``stage_params``)."""
        return placement(self.stage_ranks, self.layers, self.world_size, self.tied)

    @property
    def rank_sets(self) -> tuple[tuple[int, ...], ...]:
        """Process groups every rank must create: the stages with more than one worker (SP inside a stage) and the
        neighbour pairs whose gradients travel on a group of their own (``flexorch.workers.pipeline.p2p``); with
        stage-local parameters also every other set of ranks holding one part."""
        sets = tuple(rs for rs in self.stage_ranks if len(rs) > 1) + tuple(gradient_channels(self.stage_ranks))
        if self.stage_params:  # parts held by more than a stage (a tied embedding) are summed over their holders
            sets += tuple(rs for rs, _ in holder_sets(self.held_parts()) if len(rs) > 1 and rs not in sets)
        return sets

    def blocks(self) -> set[int]:
        """Corpus blocks this rank reads (their specs: ``Corpus.block_specs``)."""
        return {d.block for d in self.docs} if self.stage is not None else set()


def gradient_channels(stage_ranks: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """The rank pairs ``(rank j of stage r, rank j of stage r + 1)`` whose gradient messages travel on a process
    group of their own (activations travel on the world); every rank must create these groups."""
    pairs = []
    for here, there in zip(stage_ranks, stage_ranks[1:], strict=False):
        pairs += [(int(a), int(b)) for a, b in zip(here, there, strict=True)]
    return pairs


def pipeline_work(
    staged, docs: Sequence[DocRef], step: int, *, stage_params: bool = False, tied: bool = False
) -> list[PipelineWork]:
    """One PipelineWork per rank of ``staged`` (a ``StagedPlan``); ``docs[i]`` is sequence ``i`` of the batch."""
    lengths = [0] * len(docs)  # tokens of each sequence the plan covers, in one pass over the pieces
    for u in staged.plan.units:
        for p in u.pieces:
            if 0 <= p.seq < len(docs):
                lengths[p.seq] += p.end - p.start
    for i, (doc, s) in enumerate(zip(docs, lengths, strict=True)):
        if doc.length != s:
            raise ValueError(
                f"sequence {i}: the pipeline plan covers {s} tokens, document {doc.doc_id} has {doc.length}"
            )
    n = staged.num_devices
    stage_of = {r: s for s, rs in enumerate(staged.stage_ranks) for r in rs}
    num_predicted = sum(d.predicted for d in docs)
    work = []
    for rank in range(n):
        st = stage_of.get(rank)
        pipes = ()
        if st is not None:
            pipes = tuple(
                StagePipeline(p.units, tuple((op.kind, op.unit) for op in p.schedule[st]), tuple(p.checkpointed[st]))
                for p in staged.plan.pipelines
            )
        work.append(
            PipelineWork(
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
    return work
