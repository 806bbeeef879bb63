"""Run one rank's part of a planned step with FSDP2-sharded model state (``flexorch.workers.fsdp``).

The same math as :func:`~flexorch.workers.step_exec.run_step` (docs/design.md §1): each rank sums the cross-entropy
of its local tokens, autograd through the SP attention routes every token's gradient to its owner, and FSDP2's
reduce-scatter (a SUM, not a mean) leaves on each rank its shard of the gradient of the whole batch's summed
loss; every rank then divides by the global count of predicted tokens, clips by the global norm (computed over
the shards by DTensor) and steps AdamW on its shards.

What differs: FSDP gathers each layer over the whole mesh, so every rank must run the same sequence of forwards
and backwards. Every rank runs every micro-batch of the step; where the plan gives it no group it runs an empty
one (zero tokens), which takes part in the gathers and reduce-scatters and adds nothing. Gradients are
reduce-scattered after every micro-batch and accumulate in the shards (the memory-lean choice: no worker ever
holds a whole unsharded gradient).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from flexorch.config.optim import OptimConfig
from flexorch.tasks.step import StepTask
from flexorch.workers.activation_memory import saved_tensor_meter
from flexorch.workers.model import check_token_range, stored_token_ids
from flexorch.workers.model_source import set_activation_checkpointing
from flexorch.workers.optim import resident_bytes
from flexorch.workers.step_exec import (
    GroupGetter,
    StepOutcome,
    TaskLosses,
    _documents,
    begin_group,
    default_device,
    group_attention,
    micro_batch_inputs,
)

__all__ = ["run_sharded_step"]


def _idle_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of a micro-batch with no tokens on this rank: ``q`` is ``(0, h, hd)``, so is the output."""
    return q


def run_sharded_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    task: StepTask,
    blocks: dict[int, np.ndarray],
    group_of: GroupGetter,
    world: dist.ProcessGroup | None,
    optim_cfg: OptimConfig,
    *,
    vocab_size: int,
    backend: str | None = None,
    hook: Callable[[str], None] | None = None,
    gather: str = "layer",
) -> StepOutcome:
    """Run ``task`` on this rank and step the optimizer on its shards; every rank of the world runs it for the same
    step. ``hook`` as in :func:`~flexorch.workers.step_exec.run_step`. ``gather`` ('layer' or 'step',
    ``flexorch.config.sharding``): when FSDP gathers and reduces."""
    if task.work and not task.micro_batches:
        raise ValueError(f"step {task.step}: a sharded step needs the task's micro_batches count")
    hook = hook or (lambda point: None)
    t0 = time.perf_counter()
    out = StepOutcome(step=task.step, rank=task.rank, loss=0.0, num_predicted=0, local_tokens=0)
    optimizer.zero_grad(set_to_none=True)
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    local_loss = torch.zeros((), dtype=torch.float64)
    local_pred = 0
    by_mb = {w.micro_batch: w for w in task.work}
    per_task = TaskLosses(task)
    for mb in range(task.micro_batches):
        if gather == "step":  # gathered once, kept to the step's end; one reduce-scatter after the last backward
            last = mb == task.micro_batches - 1
            model.set_reshard_after_forward(False)
            model.set_reshard_after_backward(last)
            model.set_requires_gradient_sync(last)
        t_mb = time.perf_counter()
        work = by_mb.get(mb)
        if work is None:
            ids = pos = labels = torch.zeros(0, dtype=torch.int64)
            attn = _idle_attn
        else:
            tokens, cu = _documents(work, blocks)
            check_token_range(stored_token_ids(tokens), vocab_size)
            ids, pos, labels, layout = micro_batch_inputs(
                tokens, cu, work.ranks.index(task.rank), work.degree, work.kind
            )
            attn = group_attention(layout, work, group_of(work.ranks) if work.degree > 1 else None, backend)
            if work.recompute is not None:  # [sharding] activation_checkpointing = "auto": this group's choice
                set_activation_checkpointing(model, work.recompute)
        scale = begin_group(model, task, work)  # [[tasks]]: this group's adapter and loss weight
        with saved_tensor_meter(params) as meter:
            loss = model(ids.to(device), pos.to(device), attn, labels=labels.to(device))  # head + loss, chunked
        out.peak_activation_bytes = max(out.peak_activation_bytes, meter.bytes)
        hook("micro_batch")
        per_task.add(work, loss)
        if scale != 1.0:
            loss = loss * scale
        loss.backward()  # FSDP reduce-scatters each layer's gradient (a sum over the mesh) into the shards
        local_loss += loss.detach().double().cpu()
        local_pred += int((labels != -100).sum())
        if work is not None:
            out.local_tokens += int(ids.numel())
            out.peak_local_tokens = max(out.peak_local_tokens, int(ids.numel()))
            out.micro_batch_ms.append((time.perf_counter() - t_mb) * 1e3)
            out.micro_batches.append(mb)
            out.micro_batch_start_ms.append((t_mb - t0) * 1e3)
    out.compute_end_ms = (time.perf_counter() - t0) * 1e3

    return finish_sharded_step(
        out, params, local_loss, local_pred, task, world, optimizer, scheduler, optim_cfg, hook, t0, model=model,
        task_losses=per_task,
    )  # fmt: skip


def finish_sharded_step(
    out: StepOutcome,
    params: list,
    local_loss: torch.Tensor,
    local_pred: int,
    task,
    world: dist.ProcessGroup | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler,
    optim_cfg: OptimConfig,
    hook: Callable[[str], None],
    t0: float,
    *,
    model: torch.nn.Module,
    counts_norm: bool | None = None,
    task_losses: TaskLosses | None = None,
) -> StepOutcome:
    """The end of a sharded step (SP, or a pipeline stage's shard): sum the loss and predicted-token count over the
    world, check the count, divide the (reduce-scattered, summed) gradient shards by it, clip by the global norm and
    step AdamW on the shards. The norm of the shards is a DTensor reduced over this rank's mesh; with pipeline
    stages each stage's squared norm is added over the world once (``counts_norm``: this rank is its stage's first;
    None: the mesh is the world and rank 0 counts it). A rank holding no parameters (on no stage) only takes part."""
    hook("before_sync")
    t_sync = time.perf_counter()
    device = params[0].device if params else default_device()
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=False) if grads else torch.zeros(())
    norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # this mesh's gradient norm (unscaled)
    counts = task.rank == 0 if counts_norm is None else counts_norm
    extra = task_losses.sums if task_losses is not None else []  # [[tasks]]: each task's loss sum rides along
    stats = [float(local_loss), float(local_pred), norm**2 if counts else 0.0, *extra]
    stats = torch.tensor(stats, dtype=torch.float64, device=device)
    if world is not None and task.world_size > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=world)
    if task_losses is not None:
        task_losses.fill(out, stats[3:].tolist())
    total_pred = int(round(float(stats[1])))
    if total_pred != task.num_predicted:
        raise RuntimeError(
            f"step {task.step}: the world predicted {total_pred} tokens, the plan has {task.num_predicted}; "
            "a document was lost or counted twice"
        )
    scale = 1.0 / max(total_pred, 1)
    out.loss = float(stats[0]) * scale
    out.num_predicted = total_pred
    out.sync_ms = (time.perf_counter() - t_sync) * 1e3
    hook("after_sync")

    t_opt = time.perf_counter()
    out.grad_norm = float(stats[2]) ** 0.5 * scale  # the global norm of the divided gradient
    coef = scale
    if optim_cfg.grad_clip:  # torch.nn.utils.clip_grad_norm_'s coefficient, on the global norm
        coef *= min(1.0, optim_cfg.grad_clip / (out.grad_norm + 1e-6))
    for g in grads:
        g.mul_(coef)
    if optimizer is not None:
        out.lr = float(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    out.optim_ms = (time.perf_counter() - t_opt) * 1e3
    out.param_bytes = resident_bytes(model, optimizer)
    out.total_ms = (time.perf_counter() - t0) * 1e3
    return out
