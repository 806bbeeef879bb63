"""One stage's part of a pipelined step across processes: activations and gradients sent point to point.

Every stage process runs its own op list of the planned schedule (``flexorch.solver.pipeline.schedule``), in order:

:func:`run_stage_ops` is the op loop every pipelined step uses (the training workers'
``flexorch.workers.pipeline.executor`` and
:func:`run_stage_step` here, one process per stage with its own parameter copies):

* ``F u``: stage r > 0 receives unit u's hidden states ``(tokens_u, dim)`` from stage r-1 (the shape comes from the
  plan, so no shape message is sent), runs the unit forward and sends its output to stage r+1 (non-blocking);
* ``B u``: stage r < P-1 receives the gradient of that output ``(tokens_u, dim)`` from stage r+1, runs the unit
  backward and sends its input's gradient to stage r-1 (non-blocking).

Messages carry the tag ``2 * unit + (0 forward, 1 backward)`` (units numbered across the step's back-to-back
pipelines), so shapes that change per unit never get mixed up on gloo. NCCL ignores tags and matches a pair's
messages in order; that holds because ``flexorch.solver.pipeline.schedule.check_schedule`` makes every stage run the
forwards in one order and the backwards in one order. Sends are asynchronous and receives block, which is what
``flexorch.solver.pipeline.sim`` assumes when it checks the schedule for deadlocks. On NCCL a send may block its
communicator's stream until the peer posts the receive, so two neighbours sending to each other at once (an
activation one way, a gradient the other) on one communicator would deadlock; gradients therefore travel on a
group of their own per neighbour pair (``flexorch.work.pipeline.gradient_channels``, the ``grad_groups``
argument; PyTorch's own pipelining added per-direction communicators for the same reason), and each direction
progresses in the order both sides agree on. With tied embeddings the first and last stage all-reduce their two
copies' gradients at the end. Tested over gloo here; the NCCL path has not run on a GPU yet.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from flexorch.workers.pipeline.stage import StageModule, UnitInput, shard_tokens

__all__ = ["StageOps", "gradient_groups", "run_stage_ops", "run_stage_step"]


@dataclass
class StageOps:
    """What :func:`run_stage_ops` saw: the summed loss and predicted tokens of this rank (last stage), tokens held
    per unit, and every op's start (its input received) and end, ms from ``t0``, and the time it waited for its
    input (on CPU/gloo the receive blocks; on NCCL it only orders the streams, so these are enqueue times)."""

    loss: float = 0.0
    predicted: int = 0
    local_tokens: int = 0
    peak_local_tokens: int = 0
    ops: list[dict] = field(default_factory=list)


def gradient_groups(group_of, rank: int, prev: int | None, nxt: int | None) -> tuple:
    """``grad_groups`` for :func:`run_stage_ops`: the groups ``rank`` shares with ``prev`` and ``nxt`` (None at the
    ends), from ``group_of(ranks)`` (a ``ProcessGroupRegistry.group`` after ``ensure(gradient_channels(...))``)."""
    return tuple(None if peer is None else group_of((peer, rank)) for peer in (prev, nxt))


def run_stage_ops(
    stage: StageModule,
    pipelines,
    sequences: list[torch.Tensor],
    *,
    prev: int | None,
    nxt: int | None,
    n_predicted: int = 1,
    group: dist.ProcessGroup | None = None,
    grad_groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None),
    hook: Callable[[str], None] | None = None,
    t0: float | None = None,
) -> StageOps:
    """Run this rank's ops of one step: ``pipelines`` are (units, [(kind, unit), ...] of this stage, checkpointed
    layers per unit), run one after another; ``prev``/``nxt``: the world ranks this rank receives activations from
    and sends them to over ``group`` (None at the ends); ``grad_groups``: the groups it shares with ``prev`` and
    with ``nxt`` (``flexorch.work.pipeline.gradient_channels``), which carry the gradients (None: ``group``). With
    SP inside the stage (``stage.sp_group``) each message is this rank's token shard ``(t_pad/d, dim)``. The last
    stage's loss share is divided by ``n_predicted`` (1: the summed loss)."""
    t0 = time.perf_counter() if t0 is None else t0
    grad_prev, grad_next = (g if g is not None else group for g in grad_groups)
    param = next(stage.parameters())
    links = _Links(prev, nxt, group, grad_prev, grad_next, stage.cfg.dim, param.dtype, param.device)
    res = StageOps()
    base = 0
    for units, ops, ckpt in pipelines:
        inputs = [UnitInput(u.pieces, sequences) for u in units]
        sends = []
        for kind, u in ops:
            t_op = time.perf_counter()
            tag = 2 * (base + u)
            n_local = shard_tokens(inputs[u].tokens, stage.sp_degree)
            if kind == "F":
                t_ready = _forward_op(stage, links, u, inputs[u], tag, n_predicted, ckpt[u], res, sends)
                res.local_tokens += n_local
                res.peak_local_tokens = max(res.peak_local_tokens, n_local)
                if hook is not None:
                    hook("micro_batch")
            else:
                t_ready = _backward_op(stage, links, u, n_local, tag, sends)
            end = time.perf_counter()
            # start: when the op's input was there; wait: the time blocked receiving it (a bubble, transfer included)
            res.ops.append(
                {
                    "kind": kind,
                    "unit": base + u,
                    "start_ms": (t_ready - t0) * 1e3,
                    "end_ms": (end - t0) * 1e3,
                    "wait_ms": (t_ready - t_op) * 1e3,
                }
            )
        for w in sends:
            w.wait()
        stage.end_step()
        base += len(units)
    return res


@dataclass(frozen=True)
class _Links:
    """Where this rank's activations come from and go to (world ranks ``prev``/``nxt`` over ``group``; None at the
    ends) and the groups the gradients go back over; the message rows' width, dtype and device."""

    prev: int | None
    nxt: int | None
    group: dist.ProcessGroup | None
    grad_prev: dist.ProcessGroup | None
    grad_next: dist.ProcessGroup | None
    dim: int
    dtype: torch.dtype
    device: torch.device


def _forward_op(stage, links: _Links, u: int, inp, tag: int, n_predicted: int, ckpt, res, sends) -> float:
    """Unit ``u``'s forward: receive its hidden states, run the stage's layers, send them on (or, on the last stage,
    add its loss share and predicted tokens to ``res``). Returns when its input was there."""
    n_local = shard_tokens(inp.tokens, stage.sp_degree)
    x = None
    if links.prev is not None:  # (t_pad/d, dim) hidden states of unit u from the previous stage
        x = torch.empty(n_local, links.dim, dtype=links.dtype, device=links.device)
        dist.recv(x, src=links.prev, group=links.group, tag=tag)
    t_ready = time.perf_counter()
    out = stage.forward_unit(u, inp, x, n_predicted, ckpt)
    if links.nxt is not None:
        sends.append(dist.isend(out.contiguous(), dst=links.nxt, group=links.group, tag=tag))
    else:
        res.loss += float(out)
        labels = inp.shard(stage.sp_rank, stage.sp_degree)[2]  # labels of this rank's shard
        res.predicted += int((labels != -100).sum())
    return t_ready


def _backward_op(stage, links: _Links, u: int, n_local: int, tag: int, sends) -> float:
    """Unit ``u``'s backward: receive the gradient of its output, run the stage's backward, send the gradient of
    its input back. Returns when its input gradient was there."""
    g = None
    if links.nxt is not None:  # (t_pad/d, dim) gradient of unit u's output from the next stage
        g = torch.empty(n_local, links.dim, dtype=links.dtype, device=links.device)
        dist.recv(g, src=links.nxt, group=links.grad_next, tag=tag + 1)
    t_ready = time.perf_counter()
    g_in = stage.backward_unit(u, g)
    if links.prev is not None:
        sends.append(dist.isend(g_in.contiguous(), dst=links.prev, group=links.grad_prev, tag=tag + 1))
    return t_ready


def run_stage_step(
    stage: StageModule,
    stage_index: int,
    stage_ranks: list[int],
    pipelines,
    sequences: list[torch.Tensor],
    *,
    group: dist.ProcessGroup | None = None,
    grad_groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None),
    tie_group: dist.ProcessGroup | None = None,
) -> float | None:
    """Run this stage's ops of one step (one process per stage, its own parameter copies); returns the step's loss
    on the last stage, None elsewhere.

    ``pipelines``: (units, schedule, checkpointed[stage][unit]) run one after another; ``stage_ranks[r]``: the
    world rank of stage r's process; ``grad_groups``: see :func:`run_stage_ops`."""
    r, p = stage_index, len(stage_ranks)
    n_pred = sum(int(s.numel()) - 1 for s in sequences)
    mine = [(units, [(op.kind, op.unit) for op in schedule[r]], ckpt[r]) for units, schedule, ckpt in pipelines]
    prev = stage_ranks[r - 1] if r > 0 else None
    nxt = stage_ranks[r + 1] if r < p - 1 else None
    res = run_stage_ops(
        stage, mine, sequences, prev=prev, nxt=nxt, n_predicted=n_pred, group=group, grad_groups=grad_groups
    )
    if stage.cfg.tie_embeddings and p > 1 and (stage.is_first or stage.is_last):
        w = stage.tok_embeddings.weight if stage.is_first else stage.head_weight
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        dist.all_reduce(w.grad, group=tie_group)
    return res.loss if r == p - 1 else None
