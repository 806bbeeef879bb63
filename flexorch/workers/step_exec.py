"""Run one rank's part of a planned step: micro-batches on their SP groups, token-weighted gradient sync, AdamW.

The math equals one big batch on one device (docs/design.md §1, the invariant): every rank sums the cross-entropy of
its local tokens (padding and document ends masked), autograd through the SP attention routes each token's
gradient to the rank that owns it, so the SUM over all ranks of the parameter gradients is the gradient of the
summed loss of the whole global batch. One all-reduce over the world adds them up (with the loss sum and the
token count riding in the same buffer), every rank divides by the global number of predicted tokens, clips and
steps the same optimizer on the same numbers, so the replicas stay identical.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from flexorch.data.store.blocks import fetch_documents
from flexorch.work.step import HYBRID, GroupWork, StepWork, hybrid_sub_groups
from flexorch.workers.activation_memory import saved_tensor_meter
from flexorch.workers.attention.api import (
    hybrid_attn_varlen_func,
    ulysses_attn_varlen_func,
    varlen_attn_func,
    zigzag_ring_attn_varlen_func,
)
from flexorch.workers.attention.collective_waits import WAITS
from flexorch.workers.attention.sharding import Layout, contiguous_layout, hybrid_layout, shard, zigzag_layout
from flexorch.workers.model import check_token_range, next_token_labels, stored_token_ids
from flexorch.workers.model_source import set_activation_checkpointing
from flexorch.workers.optim import clip_grad_norm_, resident_bytes
from flexorch.workers.step_context import GroupGetter, StepContext

__all__ = ["StepOutcome", "run_step", "sync_and_step", "GradBucket", "micro_batch_inputs", "GroupGetter"]


@dataclass
class StepOutcome:
    """What a rank reports after a step (plain values, sent back to the driver)."""

    step: int
    rank: int
    loss: float
    """Mean cross-entropy per predicted token over the whole global batch (identical on every rank)."""
    num_predicted: int
    """Predicted tokens the world actually saw (all-reduced); must equal the plan's count."""
    local_tokens: int
    """Tokens (padding included) this rank held over all its micro-batches."""
    micro_batch_ms: list[float] = field(default_factory=list)
    """Wall time of each of this rank's groups (forward + backward, communication and waits included)."""
    micro_batches: list[int] = field(default_factory=list)
    """The micro-batch index of each entry of ``micro_batch_ms`` (a rank may sit out a micro-batch)."""
    micro_batch_start_ms: list[float] = field(default_factory=list)
    """When each of those groups started, from the start of the step on this rank."""
    wait_ms: list[float] = field(default_factory=list)
    """Of each of those groups' time, what this rank spent blocked in the group's collectives (waiting for the
    others: ``attention.collective_waits``); empty where the collectives do not block the host (NCCL) or other
    collectives run inside the micro-batch (FSDP's)."""
    compute_end_ms: float = 0.0
    """From the start of the step to the end of this rank's last micro-batch."""
    sync_ms: float = 0.0
    """Gradient all-reduce."""
    optim_ms: float = 0.0
    """Clip + optimizer + schedule."""
    total_ms: float = 0.0
    grad_norm: float = 0.0
    lr: float = 0.0
    peak_local_tokens: int = 0
    """Most tokens this rank held in one micro-batch (the plan's memory unit)."""
    peak_activation_bytes: int = 0
    """Most bytes saved for backward in one micro-batch (``flexorch.workers.activation_memory``); pipelined: most bytes
    the stage held at once for units run forward and not yet backward."""
    ops: list[dict] = field(default_factory=list)
    """Pipelined steps: this rank's ops as run, ``{"kind", "unit", "start_ms", "end_ms"}`` from its step start."""
    param_bytes: int = 0
    """Bytes of parameters, gradients and optimizer state this rank held (``flexorch.workers.optim.resident_bytes``;
    sharded: its shards; pipelined: during the step)."""
    task_losses: dict[str, float] = field(default_factory=dict)
    """``[[tasks]]``: each task's mean cross-entropy per target token over the global batch (identical on every
    rank); empty in a run of one task."""
    router_aux_loss: float | None = None
    """An MoE model that trains its router loss: the step's load-balancing loss (unweighted, identical on every
    rank; ``flexorch.workers.router_loss``); ``loss`` is the cross-entropy alone."""
    router_ms: float = 0.0
    """The forward-only pass that counted the step's routing for that loss, before the first micro-batch."""
    compile_s: float = 0.0
    """Seconds ``torch.compile`` spent compiling during this step (the first steps of a compiled model, and a
    recompile; ``flexorch.workers.compile.compile_seconds``)."""


def _documents(work: GroupWork, blocks: dict[int, np.ndarray]) -> tuple[torch.Tensor, list[int]]:
    docs = fetch_documents(blocks, work.docs)
    tokens = torch.from_numpy(np.concatenate(docs).astype(np.int64, copy=False))
    cu = [0]
    for d in docs:
        cu.append(cu[-1] + len(d))
    return tokens, cu


def micro_batch_inputs(
    tokens: torch.Tensor,
    cu_seqlens: list[int],
    group_rank: int,
    degree: int,
    kind: str,
    ulysses_degree: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Layout]:
    """(input ids, position ids, labels, layout) of one group rank; padding, document ends and tokens that are not
    loss targets get label -100. ``tokens`` as stored (``flexorch.data.targets``): the labels are computed on the
    whole micro-batch before sharding, so each shard (contiguous for Ulysses, zigzag for ring, zigzag then
    contiguous for hybrid, whose ``ulysses_degree`` it takes) keeps exactly its tokens' targets."""
    labels = next_token_labels(tokens, torch.tensor(cu_seqlens, dtype=torch.int64))
    tokens = stored_token_ids(tokens)
    if kind == HYBRID:
        layout = hybrid_layout(cu_seqlens, group_rank, degree, ulysses_degree)
    elif kind == "ring" and degree > 1:
        layout = zigzag_layout(cu_seqlens, group_rank, degree)
    else:
        layout = contiguous_layout(cu_seqlens, group_rank, degree)
    ids = shard(tokens, layout)
    lab = shard(labels, layout).masked_fill(~layout.loss_mask, -100)
    return ids, layout.position_ids, lab, layout


def sp_groups(work: GroupWork, rank: int, group_of: GroupGetter):
    """The process group(s) ``rank`` runs ``work``'s attention on (:func:`group_attention`'s ``group``): None for
    degree 1, the group, or a hybrid group's (Ulysses block, ring) of ``rank``."""
    if work.kind == HYBRID:
        return tuple(group_of(s) for s in hybrid_sub_groups(work.ranks, work.ulysses_degree, rank))
    return group_of(work.ranks) if work.degree > 1 else None


def group_attention(layout: Layout, work: GroupWork, group, backend: str | None):
    """``attn(q, k, v)`` of ``work``'s kind bound to ``layout``; ``group``: :func:`sp_groups`."""
    kw = {"cu_seqlens": layout.cu_seqlens, "max_seqlen": layout.max_seqlen, "backend": backend}
    if work.kind == HYBRID:
        ulysses_group, ring_group = group
        return functools.partial(hybrid_attn_varlen_func, ulysses_group=ulysses_group, ring_group=ring_group, **kw)
    if work.degree == 1:
        return functools.partial(varlen_attn_func, **kw)
    fn = zigzag_ring_attn_varlen_func if work.kind == "ring" else ulysses_attn_varlen_func
    return functools.partial(fn, group=group, **kw)


def begin_group(model: torch.nn.Module, rank_work: StepWork, work: GroupWork | None) -> float:
    """Activate the adapter of ``work``'s task (``[[tasks]]``; no task: the base alone) and return the factor its
    summed loss is multiplied by before the backward (:meth:`StepWork.loss_scale`; 1.0 in a run of one task)."""
    if not rank_work.task_names:
        return 1.0
    from flexorch.workers.lora import set_active_task

    set_active_task(model, rank_work.task_names[work.task] if work is not None else None)
    return rank_work.loss_scale(work.task) if work is not None else 0.0


class TaskLosses:
    """Each task's summed cross-entropy on this rank (unscaled), summed over the world with the step's stats."""

    def __init__(self, rank_work: StepWork):
        self.rank_work = rank_work
        self.sums = [0.0] * len(rank_work.task_names)

    def add(self, work: GroupWork | None, loss: torch.Tensor) -> None:
        if self.sums and work is not None:
            self.sums[work.task] += float(loss.detach())

    def fill(self, out: StepOutcome, summed) -> None:
        """``summed``: the world's sums (same order); each task's mean over its targets into ``out``."""
        t = self.rank_work
        out.task_losses = {
            name: float(x) / n if n else 0.0 for name, x, n in zip(t.task_names, summed, t.task_predicted, strict=True)
        }


def run_step(ctx: StepContext, rank_work: StepWork, blocks: dict[int, np.ndarray]) -> StepOutcome:
    """Run ``rank_work`` on this rank and step the optimizer; every rank of the world must call it for the same step.
    ``blocks``: the token blocks its documents live in; ``ctx``: the whole replica, its optimizer and the world.
    """
    model, optimizer = ctx.model, ctx.optimizer
    optimizer.zero_grad(set_to_none=False)
    params = [p for p in model.parameters() if p.requires_grad]
    run = MicroBatches(ctx, rank_work, blocks, params, next(model.parameters()).device)
    with run.router_loss(rank_work.work, ctx.world):  # an MoE model's router loss: the world's routing counted
        for work in rank_work.work:
            run.run(work)
    out = run.out
    out.compute_end_ms = (time.perf_counter() - run.t0) * 1e3

    out = sync_and_step(ctx, out, rank_work, params, run.loss, run.predicted, t0=run.t0, task_losses=run.per_task)
    out.param_bytes = resident_bytes(model, optimizer)
    return out


def _idle_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """Attention of a micro-batch with no tokens on this rank: ``q`` is ``(0, h, hd)``, so is the output. The
    keywords the model passes (``softmax_scale``, ``window``) change nothing here and are ignored."""
    return q


class MicroBatches:
    """One rank's micro-batches of a step, run one at a time (:meth:`run`: forward and backward), with what they add
    up to: the summed loss and predicted tokens (``loss``, ``predicted``), each task's loss, and the timings and
    sizes in ``out``. Shared by the replicated and the sharded executor (``workers.sharded_step``)."""

    def __init__(self, ctx: StepContext, rank_work: StepWork, blocks, params, device, waits: bool = True):
        """``waits``: report each group's ``wait_ms`` where the device's collectives block the host (the CPU); False
        where other collectives run inside the micro-batch, untimed (the sharded executor's FSDP)."""
        self.model, self.rank_work, self.blocks, self.group_of = ctx.model, rank_work, blocks, ctx.group_of
        self.waits = waits and torch.device(device).type == "cpu"
        self.vocab_size, self.backend, self.params, self.device = ctx.vocab_size, ctx.backend, params, device
        self.hook = ctx.hook
        self.t0 = time.perf_counter()
        self.out = StepOutcome(step=rank_work.step, rank=rank_work.rank, loss=0.0, num_predicted=0, local_tokens=0)
        self.loss = torch.zeros((), dtype=torch.float64)
        self.predicted = 0
        self.per_task = TaskLosses(rank_work)
        self.router = None

    @contextlib.contextmanager
    def router_loss(self, works: list, world):
        """Around the step's micro-batches (``works``, in the order this rank runs them): for an MoE model that
        trains its router loss, count the world's routing first (``flexorch.workers.router_loss.router_prepass``)
        and arm the model with it; disarmed when the block ends, however it ends."""
        from flexorch.workers.router_loss import router_prepass

        t = time.perf_counter()
        self.router = router_prepass(self, works, world, self.rank_work.world_size)
        if self.router is not None:
            self.out.router_aux_loss = self.router.aux_loss
            self.out.router_ms = (time.perf_counter() - t) * 1e3
            self.model.router_balance = self.router
        try:
            yield
        finally:
            if self.router is not None:
                self.model.router_balance = None

    def inputs(self, work: GroupWork | None):
        """``(input ids, position ids, labels, attn, real)`` of this rank's part of ``work`` (None: an idle rank's
        empty micro-batch), with the group's recompute mode set on the model; ``real``: which of its tokens are the
        batch's (not a shard's padding)."""
        if work is None:
            ids = pos = labels = torch.zeros(0, dtype=torch.int64)
            return ids, pos, labels, _idle_attn, torch.zeros(0, dtype=torch.bool)
        tokens, cu = _documents(work, self.blocks)
        check_token_range(stored_token_ids(tokens), self.vocab_size)
        group_rank = work.ranks.index(self.rank_work.rank)
        ids, pos, labels, layout = micro_batch_inputs(
            tokens, cu, group_rank, work.degree, work.kind, work.ulysses_degree
        )
        attn = group_attention(layout, work, sp_groups(work, self.rank_work.rank, self.group_of), self.backend)
        if work.recompute is not None:  # [sharding] activation_checkpointing = "auto": this group's choice
            set_activation_checkpointing(self.model, work.recompute)
        return ids, pos, labels, attn, layout.loss_mask

    def run(self, work: GroupWork | None) -> None:
        """Forward and backward of one micro-batch; ``work`` None: this rank has no tokens in it (a sharded
        model's units still gather and reduce with the others)."""
        model, rank_work, out = self.model, self.rank_work, self.out
        t_mb = time.perf_counter()
        WAITS.take_ms()  # this group's waits from here
        ids, pos, labels, attn, real = self.inputs(work)
        if self.router is not None:  # the rows of this micro-batch its router loss counts
            self.router.real = real
        scale = begin_group(model, rank_work, work)  # [[tasks]]: this group's adapter and loss weight
        d = self.device
        with saved_tensor_meter(self.params) as meter:  # activation bytes held for backward: the plan's memory
            loss = model(ids.to(d), pos.to(d), attn, labels=labels.to(d))  # head + loss, chunked
        out.peak_activation_bytes = max(out.peak_activation_bytes, meter.bytes)
        self.hook("micro_batch")
        self.per_task.add(work, loss)
        if scale != 1.0:
            loss = loss * scale
        router = self.router.take() if self.router is not None else None  # its share of the router loss
        (
            loss if router is None else loss + router
        ).backward()  # sharded: FSDP reduce-scatters each layer's gradient (a sum over the mesh) into the shards
        self.loss += loss.detach().double().cpu()
        self.predicted += int((labels != -100).sum())
        if work is not None:
            out.local_tokens += int(ids.numel())
            out.peak_local_tokens = max(out.peak_local_tokens, int(ids.numel()))
            out.micro_batch_ms.append((time.perf_counter() - t_mb) * 1e3)
            out.micro_batches.append(work.micro_batch)
            out.micro_batch_start_ms.append((t_mb - self.t0) * 1e3)
            if self.waits:
                out.wait_ms.append(WAITS.take_ms())


@dataclass(frozen=True)
class GradBucket:
    """Parameters whose gradients are summed over one process group (with stage-local parameters: the ranks that
    hold them, ``flexorch.work.placement.holder_sets``)."""

    group: dist.ProcessGroup | None
    """None: this rank is the only holder, nothing to sum."""
    params: list
    counts_in_norm: bool
    """This rank adds these gradients to the global norm (the first holder only, so each counts once)."""


def sync_and_step(
    ctx: StepContext,
    out: StepOutcome,
    rank_work,
    params: list[torch.nn.Parameter],
    local_loss: torch.Tensor,
    local_pred: int,
    *,
    t0: float,
    buckets: list[GradBucket] | None = None,
    task_losses: TaskLosses | None = None,
) -> StepOutcome:
    """The end of every step (SP or pipelined): sum the gradients, loss and predicted-token count over the world,
    check the count against the plan's, divide, clip (global norm over every parameter) and step the optimizer.
    ``local_loss``/``local_pred``: this rank's summed cross-entropy and predicted tokens; the gradients in
    ``params`` are of that sum (not yet divided).

    ``buckets`` (stage-local parameters): each bucket's gradients are summed over its holders only, and the global
    norm is the world's sum of each bucket's squared norm counted once, riding with the loss and token count;
    ``params`` are then the ones this rank holds (the optimizer skips the rest, whose gradient is None)."""
    world, optimizer, grad_clip = ctx.world, ctx.optimizer, ctx.optim_cfg.grad_clip
    ctx.hook("before_sync")
    t_sync = time.perf_counter()
    sharded = buckets is not None
    if buckets is None:  # whole replicas: one flat float32 buffer of every gradient, summed over the world
        buckets = [GradBucket(world if rank_work.world_size > 1 else None, params, True)]
    device = _device(params, buckets)
    reduced = []
    norm_sq = 0.0
    for b in buckets:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
        flat = torch.cat([g.reshape(-1).float() for g in grads]) if grads else torch.zeros(0, device=device)
        if b.group is not None:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=b.group)
        if sharded and b.counts_in_norm:
            norm_sq += float((flat.double() ** 2).sum())
        reduced.append((b.params, flat))
    scale, norm_sq = reduce_step_stats(out, rank_work, world, device, (local_loss, local_pred, norm_sq), task_losses)
    _set_divided_grads(reduced, scale)
    out.sync_ms = (time.perf_counter() - t_sync) * 1e3
    ctx.hook("after_sync")

    t_opt = time.perf_counter()
    if sharded:
        out.grad_norm = _clip_sharded(params, norm_sq**0.5 * scale, grad_clip)
    else:
        out.grad_norm = clip_grad_norm_(params, grad_clip) if grad_clip else _norm(params)
    out.lr = float(optimizer.param_groups[0]["lr"])
    optimizer.step()
    ctx.scheduler.step()
    out.optim_ms = (time.perf_counter() - t_opt) * 1e3
    out.total_ms = (time.perf_counter() - t0) * 1e3
    return out


def reduce_step_stats(out: StepOutcome, rank_work, world, device, local: tuple, task_losses) -> tuple[float, float]:
    """Sum this rank's ``local`` (summed loss, predicted tokens, squared gradient norm) and each task's loss over the
    world in one small float64 buffer, check the predicted tokens against the plan's, and put the step's loss and
    count into ``out``; returns (1 / predicted tokens: what the gradients are divided by, the summed squared
    norm)."""
    local_loss, local_pred, norm_sq = local
    extra = task_losses.sums if task_losses is not None else []  # [[tasks]]: each task's loss sum rides along
    stats = [float(local_loss), float(local_pred), norm_sq, *extra]
    stats = torch.tensor(stats, dtype=torch.float64, device=device)
    if world is not None and rank_work.world_size > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=world)
    if task_losses is not None:
        task_losses.fill(out, stats[3:].tolist())
    total_pred = int(round(float(stats[1])))
    if total_pred != rank_work.num_predicted:
        raise RuntimeError(
            f"step {rank_work.step}: the world predicted {total_pred} tokens, the plan has {rank_work.num_predicted}; "
            "a document was lost or counted twice"
        )
    scale = 1.0 / max(total_pred, 1)
    out.loss = float(stats[0]) * scale
    out.num_predicted = total_pred
    return scale, float(stats[2])


def _set_divided_grads(reduced, scale: float) -> None:
    """Each bucket's parameters get their gradient back from the summed flat buffer, times ``scale``."""
    for ps, flat in reduced:
        offset = 0
        for p in ps:
            n = p.numel()
            p.grad = (flat[offset : offset + n] * scale).to(p.dtype).view_as(p)
            offset += n


def _device(params, buckets) -> torch.device:
    """Where this rank's tensors live (a rank holding no parameter: :func:`default_device`)."""
    for p in [*params, *(q for b in buckets for q in b.params)]:
        return p.device
    return default_device()


def default_device() -> torch.device:
    """The current GPU when there is one, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _clip_sharded(params, norm: float, max_norm: float | None) -> float:
    """``torch.nn.utils.clip_grad_norm_``'s scaling (coefficient ``max_norm / (norm + 1e-6)``, at most 1) with the
    global norm computed across the holders."""
    if max_norm:
        coef = min(1.0, max_norm / (norm + 1e-6))
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm


def _norm(params) -> float:
    return float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)))
