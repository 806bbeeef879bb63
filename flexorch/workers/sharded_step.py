"""Run one rank's part of a planned step with FSDP2-sharded model state (``flexorch.workers.fsdp``).

The same math as :func:`~flexorch.workers.step_exec.run_step` (docs/design.md §1): each rank sums the cross-entropy
of its local tokens, autograd through the SP attention routes every token's gradient to its owner, and FSDP2's
reduce-scatter (a SUM, not a mean) leaves on each rank its shard of the gradient of the whole batch's summed
loss; every rank then divides by the global count of predicted tokens, clips by the global norm (computed over
the shards) and steps AdamW on its shards (``flexorch.workers.shard_optim``: on the local shards, past DTensor's
dispatch).

What differs: FSDP gathers each layer over the whole mesh, so every rank must run the same sequence of forwards
and backwards. Every rank runs every micro-batch of the step; where the plan gives it no group it runs an empty
one (zero tokens), which takes part in the gathers and reduce-scatters and adds nothing. Gradients are
reduce-scattered after every micro-batch and accumulate in the shards (the memory-lean choice: no worker ever
holds a whole unsharded gradient).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from flexorch.work.step import StepWork
from flexorch.workers.optim import resident_bytes
from flexorch.workers.shard_optim import scale_grads, shard_grad_norm
from flexorch.workers.step_context import StepContext
from flexorch.workers.step_exec import (
    MicroBatches,
    StepOutcome,
    TaskLosses,
    default_device,
    reduce_step_stats,
)

__all__ = ["run_sharded_step"]


def run_sharded_step(ctx: StepContext, rank_work: StepWork, blocks: dict[int, np.ndarray]) -> StepOutcome:
    """Run ``rank_work`` on this rank and step the optimizer on its shards; every rank of the world runs it for the
    same step. ``ctx.gather`` ('layer' or 'step', ``flexorch.config.sharding``): when FSDP gathers and reduces."""
    model, gather = ctx.model, ctx.gather
    if rank_work.work and not rank_work.micro_batches:
        raise ValueError(f"step {rank_work.step}: a sharded step needs the rank work's micro_batches count")
    ctx.optimizer.zero_grad(set_to_none=True)
    params = [p for p in model.parameters() if p.requires_grad]
    run = MicroBatches(ctx, rank_work, blocks, params, params[0].device, waits=False)  # FSDP's waits untimed
    by_mb = {w.micro_batch: w for w in rank_work.work}
    works = [by_mb.get(mb) for mb in range(rank_work.micro_batches)]
    with run.router_loss(works, ctx.world):  # an MoE model's router loss: the world's routing counted first
        for mb, work in enumerate(works):
            if gather == "step":  # gathered once, kept to the step's end; one reduce-scatter after the last backward
                last = mb == rank_work.micro_batches - 1
                model.set_reshard_after_forward(False)
                model.set_reshard_after_backward(last)
                model.set_requires_gradient_sync(last)
            run.run(work)
    out = run.out
    out.compute_end_ms = (time.perf_counter() - run.t0) * 1e3

    return finish_sharded_step(ctx, out, rank_work, params, run.loss, run.predicted, run.t0, task_losses=run.per_task)


def finish_sharded_step(
    ctx: StepContext,
    out: StepOutcome,
    rank_work,
    params: list,
    local_loss: torch.Tensor,
    local_pred: int,
    t0: float,
    *,
    counts_norm: bool | None = None,
    task_losses: TaskLosses | None = None,
) -> StepOutcome:
    """The end of a sharded step (SP, or a pipeline stage's shard): sum the loss and predicted-token count over the
    world, check the count, divide the (reduce-scattered, summed) gradient shards by it, clip by the global norm and
    step AdamW on the shards. The norm of the shards is reduced over this rank's mesh; with pipeline
    stages each stage's squared norm is added over the world once (``counts_norm``: this rank is its stage's first;
    None: the mesh is the world and rank 0 counts it). A rank holding no parameters (on no stage) only takes part."""
    world, optimizer = ctx.world, ctx.optimizer
    ctx.hook("before_sync")
    t_sync = time.perf_counter()
    device = params[0].device if params else default_device()
    grads = [p.grad for p in params if p.grad is not None]
    norm = shard_grad_norm(grads) if grads else 0.0  # this mesh's gradient norm (unscaled)
    counts = rank_work.rank == 0 if counts_norm is None else counts_norm
    norm_sq = norm**2 if counts else 0.0
    scale, norm_sq = reduce_step_stats(out, rank_work, world, device, (local_loss, local_pred, norm_sq), task_losses)
    out.sync_ms = (time.perf_counter() - t_sync) * 1e3
    ctx.hook("after_sync")

    t_opt = time.perf_counter()
    out.grad_norm = norm_sq**0.5 * scale  # the global norm of the divided gradient
    coef = scale
    if ctx.optim_cfg.grad_clip:  # torch.nn.utils.clip_grad_norm_'s coefficient, on the global norm
        coef *= min(1.0, ctx.optim_cfg.grad_clip / (out.grad_norm + 1e-6))
    scale_grads(grads, coef)
    if optimizer is not None:
        out.lr = float(optimizer.param_groups[0]["lr"])
        optimizer.step()
        ctx.scheduler.step()
    out.optim_ms = (time.perf_counter() - t_opt) * 1e3
    out.param_bytes = resident_bytes(ctx.model, optimizer)
    out.total_ms = (time.perf_counter() - t0) * 1e3
    return out
