"""Run one rank's part of a pipelined step inside a worker.

The rank's stage is a :class:`~flexorch.workers.pipeline.stage.StageModule` *sharing* the worker's model modules
(layers ``[first, last)``, plus the embedding on stage 0 and norm and head on the last stage), so the gradients of
the stage's units land in those parameters' ``.grad``. With ``[pipeline] params = "stage"`` (the default,
``rank_work.stage_params``) the worker first keeps only the parts its stage runs and releases the rest
(:class:`~flexorch.workers.pipeline.held_params.HeldParams`), so it holds its stage's layers, their gradients and
AdamW state; with ``"replicated"`` it keeps a whole replica. Ops run in the order of the plan's schedule for this
stage (``flexorch.solver.pipeline.schedule``): ``F u`` receives the unit's hidden states from the same-position rank
of the previous stage, runs the unit and sends its output on (non-blocking); ``B u`` receives the output's
gradient, runs the unit backward and sends the input's gradient back. Message shapes come from the plan
(``(t_pad/d, dim)`` per unit), tags are ``2 * unit + (0 forward, 1 backward)`` with units numbered across
back-to-back pipelines, gradients travel on a group per neighbour pair
(``flexorch.work.pipeline.gradient_channels``), sends are asynchronous and receives block: the schedule
``flexorch.solver.pipeline.sim`` checked for deadlock is what runs.

The last stage computes the units' summed cross-entropy (not divided), so the step ends like an SP step
(``flexorch.workers.step_exec.sync_and_step``): gradients are summed over the ranks that hold each part (one bucket
per set of holders; with replicas, one all-reduce over the world: each parameter has gradients only from its stage,
a tied embedding from the first and the last stage), with the loss and the predicted-token count, which must equal
the batch's; then the same division, global-norm clipping (each part counted once) and AdamW step, so the holders of
a part stay identical and checkpoints, resume and elastic shrink/grow work as without stages.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from flexorch.data.store.blocks import fetch_documents
from flexorch.work.pipeline import PipelineWork
from flexorch.work.placement import holder_sets
from flexorch.workers.model import check_token_range, stored_token_ids
from flexorch.workers.pipeline.held_params import HeldParams
from flexorch.workers.pipeline.p2p import gradient_groups, run_stage_ops
from flexorch.workers.pipeline.stage import StageModule
from flexorch.workers.step_context import StepContext
from flexorch.workers.step_exec import GradBucket, StepOutcome, sync_and_step

__all__ = ["run_pipeline_step"]


def _sequences(rank_work: PipelineWork, blocks: dict[int, np.ndarray], vocab_size: int) -> list[torch.Tensor]:
    out = []
    for stored in fetch_documents(blocks, rank_work.docs):
        seq = torch.from_numpy(stored.astype(np.int64))  # as stored
        check_token_range(stored_token_ids(seq), vocab_size)
        out.append(seq)
    return out


def run_pipeline_step(ctx: StepContext, rank_work: PipelineWork, blocks: dict[int, np.ndarray]) -> StepOutcome:
    """Run ``rank_work`` (this rank's stage ops, or nothing when it has no stage), then sync and step the optimizer.
    With ``rank_work.stage_params`` this rank first drops the parts its stage does not run (``ctx.held``).
    ``ctx.sharded``: ``ctx.model`` holds this stage's parts as FSDP2 units sharded over the stage's workers
    (``flexorch.workers.fsdp.stage_sharded_decoder``): their gradients are reduce-scattered over the stage as each
    unit's backward runs, and the step ends as a sharded SP step does."""
    model, held, group_of = ctx.model, ctx.held, ctx.group_of
    t0 = time.perf_counter()
    out = StepOutcome(step=rank_work.step, rank=rank_work.rank, loss=0.0, num_predicted=0, local_tokens=0)
    if ctx.sharded:
        return _sharded_stage_step(ctx, rank_work, blocks, out, t0)
    buckets = None
    if rank_work.stage_params:
        buckets = _stage_buckets(rank_work, held, group_of)
        params = [p for b in buckets for p in b.params]
    else:
        params = [p for p in model.parameters() if p.requires_grad]
    ctx.optimizer.zero_grad(set_to_none=False)
    local_loss = torch.zeros((), dtype=torch.float64)
    local_pred = 0
    if rank_work.stage is not None:
        sequences = _sequences(rank_work, blocks, ctx.vocab_size)
        local_loss, local_pred = _run_stage(model, rank_work, sequences, group_of, out, ctx.hook, t0)
    out.compute_end_ms = (time.perf_counter() - t0) * 1e3
    if held is not None:
        out.param_bytes = held.nbytes()
    return sync_and_step(ctx, out, rank_work, params, local_loss, local_pred, t0=t0, buckets=buckets)


def _sharded_stage_step(ctx: StepContext, rank_work, blocks, out: StepOutcome, t0: float) -> StepOutcome:
    """:func:`run_pipeline_step` with this stage's parts as FSDP2 units sharded over the stage's workers: the step
    ends as a sharded SP step does, the stage's first rank counting its stage's gradient norm."""
    from flexorch.workers.sharded_step import finish_sharded_step

    params = [p for p in ctx.model.parameters() if p.requires_grad]
    if ctx.optimizer is not None:
        ctx.optimizer.zero_grad(set_to_none=True)
    local_loss, local_pred = torch.zeros((), dtype=torch.float64), 0
    if rank_work.stage is not None:
        sequences = _sequences(rank_work, blocks, ctx.vocab_size)
        local_loss, local_pred = _run_stage(ctx.model, rank_work, sequences, ctx.group_of, out, ctx.hook, t0)
    out.compute_end_ms = (time.perf_counter() - t0) * 1e3
    first = rank_work.stage is not None and rank_work.rank == rank_work.stage_ranks[rank_work.stage][0]
    return finish_sharded_step(ctx, out, rank_work, params, local_loss, local_pred, t0, counts_norm=first)


def _stage_buckets(rank_work: PipelineWork, held: HeldParams, group_of) -> list[GradBucket]:
    """Keep only this rank's parts; one gradient bucket per set of ranks holding the same parts (in the same order
    on every rank: ``holder_sets``), summed over those ranks, counted in the norm by the first of them."""
    placed = rank_work.held_parts()
    parts = placed[rank_work.rank]
    held.release(parts)
    held.require(parts, f"rank {rank_work.rank} (stage {rank_work.stage})")
    buckets = []
    for ranks, bucket_parts in holder_sets(placed):
        if rank_work.rank in ranks:
            ps = [p for n, p in held.params.items() if held.part[n] in bucket_parts and p.requires_grad]
            group = group_of(ranks) if len(ranks) > 1 else None
            buckets.append(GradBucket(group, ps, rank_work.rank == ranks[0]))
    return buckets


def _is_fsdp(model) -> bool:
    """The stage's parts are FSDP2 units: they recompute inside their forward (``Block.recompute``), since
    recomputing an FSDP unit's call from outside would gather it again."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _run_stage(model, rank_work: PipelineWork, sequences, group_of, out: StepOutcome, hook, t0: float):
    r, p = rank_work.stage, len(rank_work.stage_ranks)
    ranks = rank_work.stage_ranks[r]
    d, j = len(ranks), ranks.index(rank_work.rank)
    first = sum(rank_work.layers[:r])
    stage = StageModule(
        model.cfg, first, first + rank_work.layers[r], r, p, model=model, sp_group=group_of(ranks) if d > 1 else None
    )
    stage.inner_checkpoint = _is_fsdp(model)
    pipes = [(pipe.units, pipe.ops, pipe.checkpointed) for pipe in rank_work.pipelines]
    prev = rank_work.stage_ranks[r - 1][j] if r > 0 else None  # the same-position rank of the neighbouring stages
    nxt = rank_work.stage_ranks[r + 1][j] if r < p - 1 else None
    res = run_stage_ops(
        stage,
        pipes,
        sequences,
        prev=prev,
        nxt=nxt,
        grad_groups=gradient_groups(group_of, rank_work.rank, prev, nxt),
        hook=hook,
        t0=t0,
    )  # the last stage's loss is the summed cross-entropy (n_predicted = 1): sync_and_step divides
    out.local_tokens, out.peak_local_tokens, out.ops = res.local_tokens, res.peak_local_tokens, res.ops
    out.peak_activation_bytes = int(stage.peak_held_bytes)
    return res.loss, res.predicted
